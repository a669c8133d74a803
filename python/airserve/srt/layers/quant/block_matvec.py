"""Decode-time products with GGML block-quantized weights (Q4_0/Q4_1, Q8_0), kept packed.

A GGUF model's linear weights are read from the file as blocks of 32 values with fp16 scales.
Besides the float32 copy that prefill uses, a `PackedWeight` keeps those blocks as they are, and
`packed_linear` multiplies small batches (decode) with them through two C++ operators
(`csrc/block_matvec.cpp`, built on first use): a step reads about a quarter of the float32
bytes. The operators compute in float32 from the exact block values, so they equal `x @ w.T`
with the dequantized weights up to summation order.

If the operators cannot be built (no C++ compiler), `kernels_available()` says why once in the
log and the model keeps using its float32 weights; the model runner reports which path it uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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

    def values(self) -> torch.Tensor:
        """The integer values q of every block in K order: [N, K/32, 32], uint8 (q4_1, 0..15)
        or int8 (q8_0)."""
        n = self.qs.shape[0]
        if self.kind == "q8_0":
            return self.qs.view(n, -1, BLOCK)
        q = self.qs.view(n, -1, BLOCK // 2)
        return torch.cat([q & 15, q >> 4], dim=-1)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], the reference the operators are tested against."""
        n = self.qs.shape[0]
        w = self.values().float() * self.d.float().unsqueeze(-1)
        if self.m is not None:
            w = w + self.m.float().unsqueeze(-1)
        return w.reshape(n, -1)


def block_matmul(x: torch.Tensor, kind: str, qs: torch.Tensor, d: torch.Tensor,
                 m: torch.Tensor | None) -> torch.Tensor:
    """x: float32 [M <= MAX_ROWS, K] -> [M, N] = x @ dequantize(weight).T, for the weight
    whose `PackedWeight` fields are (kind, qs, d, m)."""
    if kind == "q4_1":
        return torch.ops.airserve.q4_1_matmul(x, qs, d, m)
    return torch.ops.airserve.q8_0_matmul(x, qs, d)


def packed_linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    return block_matmul(x, w.kind, w.qs, w.d, w.m)


def kernels_available() -> bool:
    """Whether the C++ operators are built and loaded (see airserve.srt.layers.cpu_kernels)."""
    from airserve.srt.layers import cpu_kernels

    return cpu_kernels.available()


def unavailable_reason() -> str | None:
    from airserve.srt.layers import cpu_kernels

    return cpu_kernels.unavailable_reason()
