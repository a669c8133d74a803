"""GGUF block weights in the form OpenVINO keeps compressed: u4 / i8 constants it decompresses
inside its matmuls.

OpenVINO's CPU (and GPU) plugin fuses `Convert(u4 or i8 constant) * scale -> MatMul` into one
FullyConnected layer that reads the 4/8-bit weights as they are (the pattern NNCF's weight
compression produces). Its PyTorch frontend makes a u4 constant from
`stack((w & 15, w >> 4), -1)` on a uint8 constant (low nibble first), and an i8 constant from an
int8 one. So `OpenVINOLinear.forward` spells a Q4_1 / Q8_0 product in exactly those torch ops;
compiled for OpenVINO with its buffers frozen, each becomes a compressed-weight FullyConnected
(`test_openvino_linear.py` checks the compiled model's weight types). Sources: openvino's
`u4_compression_stack` (src/frontends/pytorch/src/utils_quantize.cpp) and the torch.compile
backend's `Partitioner.capture_nncf_patterns` (frontend/pytorch/torchdynamo/partition.py), which
keeps that pattern inside the OpenVINO partition.

Q4_1 (and Q4_0, carried as Q4_1) values are `d * q + m` per block of 32, written either with a
float zero point or with m as a separate small matmul (see `OpenVINOLinear`); both give the
dequantized weight's values up to float32 rounding.

The model's merged projections (q/k/v, gate/up) stay one layer: one matmul when their blocks
share a kind, one per segment otherwise. The graphs also hold about a fifth of the bytes of float32
constants (~100 vs 513 MiB for the default model); every compiled graph holds its own copy.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from airserve.srt.layers.linear import OPAQUE_WEIGHTS, Linear
from airserve.srt.layers.quant.block_matvec import BLOCK, PackedWeight


def u4_pairs(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [N, K/32, 32] in K order (`PackedWeight.values()`) -> uint8 [N, K/2] with
    values 2i and 2i + 1 in byte i (low nibble first), the order of OpenVINO's u4 constants."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).reshape(values.shape[0], -1)


class OpenVINOLinear(nn.Module):
    """y = x @ w.T (+ bias) for a GGUF block weight, in ops OpenVINO compiles to a
    compressed-weight matmul. For OpenVINO graphs only: run eagerly it dequantizes the weight on
    every call.

    Q4_1 values d * q + m take one of two forms. `zero_point=True`: d * (q - z) with a float
    zero point z = -m / d (one matmul; OpenVINO keeps float activations for it). False: d * q,
    plus m times each block's sum of x as a second, small float16 matmul; the form OpenVINO's
    int8-activation kernels (DYNAMIC_QUANTIZATION_GROUP_SIZE) take, as they need integer zero
    points.
    """

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None,
                 zero_point: bool = True) -> None:
        super().__init__()
        if packed.kind not in OPENVINO_KINDS:
            raise ValueError(f"OpenVINOLinear: unknown block kind {packed.kind!r} (OpenVINO "
                             f"keeps {', '.join(OPENVINO_KINDS)} compressed)")
        self.kind = packed.kind
        self.out_features, self.in_features = packed.shape
        n, groups = self.out_features, self.in_features // BLOCK
        d = packed.d.float().view(n, groups, 1)
        zp = m = None
        if packed.kind == "q8_0":
            q = packed.values()
        else:  # q4_1
            q = u4_pairs(packed.values())
            if zero_point:
                # A block with d == 0 holds m 32 times: q = 0, scale 1, zero point -m.
                flat = d == 0
                m_ = packed.m.float().view(n, groups, 1)
                zp = torch.where(flat, -m_, -m_ / torch.where(flat, 1.0, d))
                q = torch.where(flat, 0, q.view(n, groups, BLOCK // 2)).view(n, -1)
                d = torch.where(flat, 1.0, d)
            else:
                m = packed.m.contiguous()  # float16 [N, K/32]
        self.register_buffer("qs", q.contiguous())
        self.register_buffer("scale", d)  # float32 [N, K/32, 1]
        self.register_buffer("zp", zp)  # float32 [N, K/32, 1] or None
        self.register_buffer("m", m)
        self.bias = bias

    def weight_q(self) -> torch.Tensor:
        """The integer values q, [N, K/32, 32], as ops OpenVINO folds into a u4/i8 constant."""
        n, groups = self.out_features, self.in_features // BLOCK
        if self.kind == "q8_0":
            return self.qs
        pairs = torch.stack((torch.bitwise_and(self.qs, 15),
                             torch.bitwise_right_shift(self.qs, 4)), dim=-1)
        return pairs.view(n, groups, BLOCK)

    def forward(self, x: torch.Tensor, decode: bool = False,
                keep_bf16: bool = False, float_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        # `decode`, `keep_bf16` and `float_rows` (Linear.forward's) change nothing here:
        # OpenVINO picks its own activation precision for these graphs
        # (--openvino-dynamic-quant-group-size), and these layers hold no int8_blocks.
        n, k = self.out_features, self.in_features
        q = self.weight_q().to(x.dtype)
        if self.zp is not None:
            q = q - self.zp.to(x.dtype)
        y = F.linear(x, (q * self.scale.to(x.dtype)).view(n, k))
        if self.m is not None:
            sums = x.reshape(*x.shape[:-1], k // BLOCK, BLOCK).sum(-1)
            y = y + F.linear(sums, self.m.to(x.dtype))
        return y if self.bias is None else y + self.bias


# Block kinds OpenVINO keeps compressed (u4 / i8); layers of other kinds keep their Linear.
OPENVINO_KINDS = ("q4_1", "q8_0")


class ConcatLinear(nn.Module):
    """A merged layer whose block segments differ in kind (say q/k in Q4_1, v in Q8_0): one
    compressed matmul per segment, outputs side by side."""

    def __init__(self, parts: list[OpenVINOLinear], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = bias

    def forward(self, x: torch.Tensor, decode: bool = False,
                keep_bf16: bool = False, float_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        y = torch.cat([p(x, decode) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias


def openvino_linear(layer: Linear, zero_point: bool) -> nn.Module | None:
    """The OpenVINO form of `layer`'s blocks, or None if a segment is of a kind OpenVINO does
    not keep compressed. Merged projections (q/k/v, gate/up) stay one layer: fewer, larger
    compressed matmuls (~10% of a bs-1 step for the default model)."""
    parts = layer.packed_parts
    if not parts or any(p.kind not in OPENVINO_KINDS for p in parts):
        return None
    if len(parts) == 1:
        return OpenVINOLinear(parts[0], layer.bias, zero_point)
    return ConcatLinear([OpenVINOLinear(p, None, zero_point) for p in parts], layer.bias)


def with_openvino_linears(model: nn.Module, zero_point: bool = True) -> tuple[nn.Module, int]:
    """A copy of `model` for OpenVINO graphs: each `Linear` holding GGUF blocks of OpenVINO's
    kinds becomes an `OpenVINOLinear(zero_point=...)` (a `ConcatLinear` of them for mixed
    segments); every other tensor is shared with `model`, not copied. Returns the copy and how
    many layers run from blocks (0: no blocks, a float model). A layer of a model loaded for
    another runner may hold its float32 weight reordered for oneDNN (opaque to OpenVINO): its
    copy gets the plain weight back."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for module in model.modules():  # weights held outside torch tensors: shared, not copied
        for attr in OPAQUE_WEIGHTS:
            if getattr(module, attr, None) is not None:
                shared[id(getattr(module, attr))] = getattr(module, attr)
    clone = copy.deepcopy(model, memo=shared)
    replaced = 0
    for name, module in list(clone.named_modules()):
        if not isinstance(module, Linear):
            continue
        ov = openvino_linear(module, zero_point)
        if ov is None:
            if module.float32_impl == "onednn":
                module.set_large_path("float32", float32_impl="sgemm")
            continue
        parent, _, child = name.rpartition(".")
        owner = clone.get_submodule(parent) if parent else clone
        setattr(owner, child, ov)
        replaced += 1
    return clone, replaced
