"""airserve's C++ operators for the host CPU, built on first use and cached on disk by torch.

`csrc/block_matvec.cpp` and `csrc/block_int8.cpp` (products with GGUF block-quantized weights),
`csrc/packed_or_large.cpp` (a layer's packed or large product, picked by the row count per call),
`csrc/decode_attention.cpp` (paged decode and prefill attention, float32), `csrc/activation.cpp`
(the MLP's silu(gate) * up over a bf16 gate/up product), `csrc/logits.cpp` (greedy sampling's
argmax per row, and the float32 refinement of bf16-rounded top logits) and `csrc/norm_rope.cpp`
(RMSNorm and the rotary embedding of eager passes) are compiled together for this
CPU (-march=native). block_int8.cpp also compiles its int8 products for AVX-512 VNNI, AVX-VNNI
and AVX2, and block_matvec.cpp its float32 products for AVX-512 and AVX2+FMA+F16C, through target
options whatever this CPU is; each picks one at run time from the CPU's features. Their schemas
are defined where they are used (`quant/block_matvec.py`, `quant/packed_or_large.py`,
`attention/torch_native_backend.py`, `activation.py`, `norm_rope.py`, `sampling/sampler.py`).
Without a C++ compiler `available()` is False, says why once in the log, and the callers keep
their plain-torch paths (the model runner reports which).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time

logger = logging.getLogger(__name__)

SOURCES = ("block_matvec.cpp", "block_int8.cpp", "block_int16.cpp", "block_int16_k.cpp",
           "decode_attention.cpp", "packed_or_large.cpp", "activation.cpp", "logits.cpp",
           "norm_rope.cpp", "block_int8_gemm.cpp")
# Included by the sources: part of the build name, with the sources.
HEADERS = ("block_unpack.h", "block_int8_rows.inc", "block_int8_pairs.inc", "block_int8_q5.inc",
           "block_int8_avx2.inc", "block_f32.h", "block_f32_rows.inc", "block_f32_q5.inc",
           "block_f32_k.inc", "decode_attention_avx2.inc", "decode_attention_avx512.inc",
           "decode_attention_simd.inc", "prefill_attention_simd.inc", "isa_select.h",
           "avx2_common.inc", "cpu_common.h", "prefetch_column.inc", "int16_rows.h",
           "int8_quantize.h")
# torch's build lock: a build killed midway leaves it behind, and every later start would wait
# on it forever. A real build of these sources takes well under this many seconds (2-6
# minutes on a busy 2-core machine: a shorter limit would start a second build in the same
# directory while the first still runs).
STALE_LOCK_SECONDS = 900
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


def _sources_tag(here: str) -> str:
    """The sources' directory and contents, included files too. torch keys its build directory
    by the name alone and rebuilds there whenever build.ninja changes, as it does with the
    sources' paths: two checkouts sharing a name in one cache (~/.cache/torch_extensions by
    default) rebuilt it in turn, each holding torch's build lock for minutes on a busy machine
    while every other process of both waited. torch does not see included files change."""
    digest = hashlib.sha1(os.path.realpath(here).encode())
    for name in SOURCES + HEADERS:
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:8]


def build_name() -> str:
    """The extension's name, hence its build directory under TORCH_EXTENSIONS_DIR."""
    here = os.path.join(os.path.dirname(__file__), "csrc")
    return f"airserve_cpu_kernels_{_cpu_tag()}_{_sources_tag(here)}"


def build_jobs(environ=os.environ, cpus: int | None = None) -> str | None:
    """Parallel compiler jobs for the build (torch's cpp_extension reads MAX_JOBS): one per
    core this process may run on, unless MAX_JOBS is set. Without it ninja runs cores + 2, and
    each job is a compiler of ~400-800 MiB: on a 2-core AMD EPYC the build peaked at 2852 MiB
    with three at once against 1999 MiB with two, in the same 55 s
    (benchmark/kernels/build_memory.py)."""
    if "MAX_JOBS" in environ:
        return None
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
    return str(max(1, cpus))


def available() -> bool:
    """Build (first call in a fresh cache: ~15-30 s) and load the operators."""
    if "ok" in _state:
        return bool(_state["ok"])
    from torch.utils import cpp_extension

    here = os.path.join(os.path.dirname(__file__), "csrc")
    name = build_name()
    try:
        _remove_stale_lock(cpp_extension._get_build_directory(name, verbose=False))
        jobs = build_jobs()
        if jobs is not None:
            os.environ["MAX_JOBS"] = jobs
        try:
            cpp_extension.load(
                name=name,
                sources=[os.path.join(here, s) for s in SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                is_python_module=False, verbose=False)
        finally:
            if jobs is not None:
                os.environ.pop("MAX_JOBS", None)
        _state["ok"] = True
    except Exception as e:  # a missing compiler shows up as several exception types
        _state["ok"] = False
        _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        logger.warning("airserve's CPU kernels could not be built (%s); decode uses plain torch "
                       "ops and float32 weights. Install a C++ compiler (g++) to enable them.",
                       _state["error"])
    return bool(_state["ok"])


def _remove_stale_lock(build_dir: str) -> None:
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return  # no lock: nobody is building
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing a stale build lock %s (%.0f s old, left by an interrupted "
                       "build)", lock, age)
        try:
            os.remove(lock)
        except FileNotFoundError:
            pass


def unavailable_reason() -> str | None:
    return _state.get("error")  # type: ignore[return-value]
