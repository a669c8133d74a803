"""RMSNorm and the rotary embedding as one C++ pass each (csrc/norm_rope.cpp) for eager passes
on the host CPU in float32: prefills, chunks and mixed steps, which run op by op (compiled
decode graphs fuse the same arithmetic themselves). Same arithmetic as models/llama's torch
ops: the rotation is bit for bit theirs, the norm differs only in the order its sum of squares
is added."""

from __future__ import annotations

import torch

from airserve.srt.layers import cpu_kernels

_lib = torch.library.Library("airserve", "FRAGMENT")
_lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_lib.define("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor")
# rms_norm rounded to bf16 in the same pass, for a product that multiplies in bf16.
_lib.define("rms_norm_bf16(Tensor x, Tensor weight, float eps) -> Tensor")
# The same operators' plain C++ loops (any CPU): for tests against the vector ones.
_lib.define("rms_norm_portable(Tensor x, Tensor weight, float eps) -> Tensor")
_lib.define("rotary_portable(Tensor x, Tensor cos, Tensor sin) -> Tensor")


def fused_eager(x: torch.Tensor) -> bool:
    """Whether `x` takes the C++ operators: a float32 CPU tensor outside a compiled graph, with
    the operators built."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return cpu_kernels.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) over the last dimension of float32 x."""
    flat = x.reshape(-1, x.shape[-1])
    return torch.ops.airserve.rms_norm(flat, weight, eps).view(x.shape)


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm(x, weight, eps).to(torch.bfloat16)`, bit for bit, in one pass (x [T, D])."""
    return torch.ops.airserve.rms_norm_bf16(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] * cos + swap_halves(x) * sin, with cos/sin [T, 1, D] (RotaryEmbedding's
    lookup); a new contiguous tensor."""
    return torch.ops.airserve.rotary(x, cos.squeeze(1), sin.squeeze(1))
