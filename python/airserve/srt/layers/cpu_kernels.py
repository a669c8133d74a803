"""airserve's C++ operators for the host CPU, built on first use and cached on disk by torch.

`csrc/block_matvec.cpp` (products with GGUF block-quantized weights) and
`csrc/decode_attention.cpp` (paged decode attention, float32) are compiled together for this
CPU (-march=native). Their schemas are defined where they are used (`quant/block_matvec.py`,
`attention/torch_native_backend.py`). Without a C++ compiler `available()` is False, says why
once in the log, and the callers keep their plain-torch paths (the model runner reports which).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform

logger = logging.getLogger(__name__)

SOURCES = ("block_matvec.cpp", "decode_attention.cpp")
_state: dict[str, object] = {}


def _cpu_tag() -> str:
    """Build name suffix: the operators are compiled for this CPU's instruction set."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def available() -> bool:
    """Build (first call in a fresh cache: ~15-30 s) and load the operators."""
    if "ok" in _state:
        return bool(_state["ok"])
    from torch.utils import cpp_extension

    here = os.path.join(os.path.dirname(__file__), "csrc")
    try:
        cpp_extension.load(
            name=f"airserve_cpu_kernels_{_cpu_tag()}",
            sources=[os.path.join(here, s) for s in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
            is_python_module=False, verbose=False)
        _state["ok"] = True
    except Exception as e:  # a missing compiler shows up as several exception types
        _state["ok"] = False
        _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        logger.warning("airserve's CPU kernels could not be built (%s); decode uses plain torch "
                       "ops and float32 weights. Install a C++ compiler (g++) to enable them.",
                       _state["error"])
    return bool(_state["ok"])


def unavailable_reason() -> str | None:
    return _state.get("error")  # type: ignore[return-value]
