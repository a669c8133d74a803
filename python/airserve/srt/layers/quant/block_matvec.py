"""Decode-time products with GGML block-quantized weights (Q4_0/Q4_1, Q8_0), kept packed.

A GGUF model's linear weights are read from the file as blocks of 32 values with fp16 scales.
Besides the float32 copy that prefill uses, a `PackedWeight` keeps those blocks as they are, and
`packed_linear` multiplies small batches (decode) with them through two C++ operators built on
first use (`block_matvec.cpp`): a step then reads about a quarter of the float32 bytes. The
operators compute in float32 from the exact block values, so they equal `x @ w.T` with the
dequantized weights up to summation order.

If the operators cannot be built (no C++ compiler), `kernels_available()` says why once in the
log and the model keeps using its float32 weights; the model runner reports which path it uses.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

BLOCK = 32
MAX_ROWS = 16  # the operators unpack a weight block once for at most this many rows of x

_lib = torch.library.Library("airserve", "FRAGMENT")
_lib.define("q4_1_matmul(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor")
_lib.define("q8_0_matmul(Tensor x, Tensor qs, Tensor d) -> Tensor")


@torch.library.register_fake("airserve::q4_1_matmul")
def _q4_1_fake(x, qs, d, m):
    return x.new_empty(x.shape[0], qs.shape[0])


@torch.library.register_fake("airserve::q8_0_matmul")
def _q8_0_fake(x, qs, d):
    return x.new_empty(x.shape[0], qs.shape[0])


@dataclass
class PackedWeight:
    """A [N, K] weight in GGML blocks of 32 along K.

    kind "q4_1": qs uint8 [N, K/2] (byte j of a block: value j low nibble, value j+16 high),
    d and m float16 [N, K/32], value = d * q + m. kind "q8_0": qs int8 [N, K], d float16
    [N, K/32], m None, value = d * q.
    """

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        n = self.qs.shape[0]
        return (n, self.qs.shape[1] * (2 if self.kind == "q4_1" else 1))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m)
                   if t is not None)

    def rows(self, index: torch.Tensor | slice) -> PackedWeight:
        """The same weight with its output rows reordered or sliced."""
        m = None if self.m is None else self.m[index].contiguous()
        return PackedWeight(self.kind, self.qs[index].contiguous(), self.d[index].contiguous(), m)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], the reference the operators are tested against."""
        n = self.qs.shape[0]
        d = self.d.float().unsqueeze(-1)
        if self.kind == "q8_0":
            return (self.qs.view(n, -1, BLOCK).float() * d).reshape(n, -1)
        q = self.qs.view(n, -1, BLOCK // 2)
        values = torch.cat([q & 15, q >> 4], dim=-1).float()
        return (values * d + self.m.float().unsqueeze(-1)).reshape(n, -1)


def packed_linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x: float32 [M <= MAX_ROWS, K] -> [M, N] = x @ dequantize(w).T."""
    if w.kind == "q4_1":
        return torch.ops.airserve.q4_1_matmul(x, w.qs, w.d, w.m)
    return torch.ops.airserve.q8_0_matmul(x, w.qs, w.d)


_state: dict[str, object] = {}


def _cpu_tag() -> str:
    """Build name suffix: the kernels are compiled for this CPU (-march=native)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def kernels_available() -> bool:
    """Build (first call; cached on disk by torch) and load the C++ operators."""
    if "ok" in _state:
        return bool(_state["ok"])
    from torch.utils import cpp_extension

    source = os.path.join(os.path.dirname(__file__), "block_matvec.cpp")
    try:
        cpp_extension.load(
            name=f"airserve_block_matvec_{_cpu_tag()}", sources=[source],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
            is_python_module=False, verbose=False)
        _state["ok"] = True
    except Exception as e:  # a missing compiler shows up as several exception types
        _state["ok"] = False
        _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        logger.warning("block-quantized decode kernels could not be built (%s); decode uses the "
                       "float32 weights. Install a C++ compiler (g++) to enable them.",
                       _state["error"])
    return bool(_state["ok"])


def unavailable_reason() -> str | None:
    return _state.get("error")  # type: ignore[return-value]
