"""How a linear layer multiplies inputs above the packed decode limit (prefill, large batches).

Small decode batches multiply with the GGUF blocks as stored (`block_matvec`); they are
bandwidth-bound. Larger inputs are compute-bound, and the fastest way to multiply them depends
on the CPU. A layer holds the weight form of one of these paths (`Linear.set_large_path`):

  float32    F.linear over float32 weights (oneDNN/MKL sgemm). Exact; always available.
  bfloat16   bf16 weights (reordered once for oneDNN: `Bf16Weight`) and activations cast to
             bf16 per product, result cast back to float32 (avx512_bf16 or AMX make it ~2-3x
             float32; without them oneDNN emulates bf16 and it is slower than float32, so it is
             refused there). down_proj layers (BF16_RESIDUAL_LAYERS) add back, in float32, the
             bf16 rounding error of a few outlier input channels found at load.
  float16_weights  float16 weights (fbgemm's packed layout), float32 activations and float32
             arithmetic (fbgemm converts the weight tiles as it multiplies: AVX2 or AVX-512,
             chosen by fbgemm at run time). Half the weight bytes of float32; the only
             rounding is the weight's to float16 (11 significant bits, no activation rounding).
             Where a CPU has no bf16 dot products it multiplies faster than oneDNN's float32
             at this model's decode-batch shapes (measured: the note above `Fp16Weight`).
  w8a8_int8  SGLang's name: int8 weights per output channel, activations quantized per token
             (dynamic, 7-bit: fbgemm's reduce_range), integer products in fbgemm (AVX2 or
             AVX-512 kernels, chosen by fbgemm at run time). fbgemm packs from torch's
             quantized tensors, which torch deprecates; a torch without them loses this path.
  w8a8_int8_outliers  w8a8_int8 with a fixed set of input channels per layer (its outlier
             channels, found at load by a calibration prefill: quant.int8_calibration) left out
             of the int8 product and multiplied in float32 beside it (LLM.int8()'s
             decomposition, with the channels chosen once instead of per batch), so the
             per-token int8 step is sized by the ordinary channels; and 8-bit activations
             with 7-bit weights (fbgemm without reduce_range), which measured closer to
             float32 than w8a8_int8's 7-bit activations with 8-bit weights.

Beside its large path a Q4_1 layer may hold a second form, for its decode batches above the
packed limit and the extend rows whose logits are not read:

  int8_blocks  the layer's Q4_1 blocks repacked (`pack_int8_blocks`) and activations quantized
             to int8 per block of 32, as the packed decode products' int8 (same quantizer, same
             integer sums), multiplied by maddubs tiles (csrc/block_int8_gemm.cpp). The loader
             gives it to some Q4_1 layers (--cpu-large-activations; under auto the
             AUTO_LARGE_INT8_ROLES beside float16_weights: `Linear.set_large_int8`); an
             extend's rows whose logits are read stay on the large path.

`choose_large_path` resolves --dtype / --quantization for this CPU; `auto` takes the fastest
path measured for the CPU whose fidelity passed (`FIDELITY`).

The float32 path has two implementations (`FLOAT32_IMPLS`, --cpu-float32-matmul): "sgemm",
F.linear over the plain [N, K] weight, and "onednn", oneDNN's float32 matmul over the weight
reordered once into oneDNN's blocked layout (`pack_float32`). Both are float32 products; they
differ only in summation order. The reordered weight replaces the plain one.
"""

from __future__ import annotations

import itertools
import logging
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# What each path is and how flags choose one, without torch (the HTTP process checks the flags).
from airserve.srt.layers.quant.path_choice import (  # noqa: F401 - re-exported
    AUTO_LARGE_INT8_EDGE_DIVISOR,
    AUTO_LARGE_INT8_ROLES,
    BF16_FLAGS,
    BF16_RESIDUAL_CHANNELS,
    BF16_RESIDUAL_LAYERS,
    DEFAULT_OUTLIER_CHANNELS,
    FBGEMM_PATHS,
    FIDELITY,
    FLOAT32_IMPLS,
    INT8_PATHS,
    LARGE_ACTIVATIONS,
    PATHS,
    QUANTIZATIONS,
    auto_eligible,
    auto_large_int8_layer,
    auto_path,
    check_float32_impl,
    check_large_activations,
    choose_float32_impl,
    choose_large_path,
    cpu_has_bf16,
    fbgemm_cpu,
    int8_available,
    onednn_available,
)

logger = logging.getLogger(__name__)

# The batch size oneDNN lays the reordered weight out for. On the default model's shapes
# (benchmark/kernels/bench_matmul_paths.py --onednn-hints, 2 threads, AVX2 EPYC) hints of 16,
# 64, 256 and 1024 differed by less than the noise of the shared machine at M = 9..2048
# (results/matmul_float32_onednn_hints_amd_epyc_avx2.json), all ahead of sgemm in most rows;
# 64 (the W2 decode batch) stays.
ONEDNN_BATCH_HINT = 64


@dataclass
class Int8Weight:
    """A [N, K] weight as fbgemm's packed int8 (per output channel) and its shape; with
    `outliers`, those input channels are left out of the int8 product and multiplied in float32
    by `outlier_weight` ([k, N], the weight's columns at `outliers`, transposed)."""

    packed: object  # torch.classes.quantized.LinearPackedParamsBase
    out_features: int
    nbytes: int
    handle: int = -1
    outliers: torch.Tensor | None = None  # int64 [k], sorted input channels
    outlier_weight: torch.Tensor | None = None  # float32 [k, N]
    weight_bits: int = 8  # 8: 7-bit activations; 7: 8-bit activations (see pack_int8)


# The packed int8 weights by the handle each layer passes to airserve::w8a8_linear (the
# operator takes tensors and ints only, so compiled graphs call it like any other op). The
# layer holds its Int8Weight; the entry goes when the layer does.
_INT8_WEIGHTS: weakref.WeakValueDictionary[int, Int8Weight] = weakref.WeakValueDictionary()
_handles = itertools.count()

_lib = torch.library.Library("airserve", "FRAGMENT")
_lib.define("w8a8_linear(Tensor x, int handle) -> Tensor")


@torch.library.impl(_lib, "w8a8_linear", "CPU")
def _w8a8_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    weight = _INT8_WEIGHTS[handle]
    if weight.outliers is not None:  # outlier channels: float32, beside the int8 product
        x_out = x.index_select(1, weight.outliers)
        x = x.index_fill(1, weight.outliers, 0.0)
    # fbgemm quantizes its whole input with one scale, which would make a row's result depend
    # on the other rows of the batch (and on padding). Each row is scaled to max |x| = 1 first
    # and one extra row [1, -1, 0, ...] pins the tensor's range to [-1, 1], so every row is
    # quantized alone (per token) with the same step in any batch; the scale is undone after.
    amax = x.abs().amax(1, keepdim=True).clamp(min=1e-30)
    pin = x.new_zeros(1, x.shape[1])
    pin[0, :2] = torch.tensor([1.0, -1.0])
    torch.backends.quantized.engine = "fbgemm"
    # AVX2 sums pairs of u8 x s8 products in int16: 7-bit activations (reduce_range) with
    # 8-bit weights, or 8-bit activations with 7-bit weights, cannot saturate it.
    out = torch.ops.quantized.linear_dynamic(torch.cat([x / amax, pin]), weight.packed,
                                             weight.weight_bits == 8)
    out = out[:-1] * amax
    if weight.outliers is not None:
        out.addmm_(x_out, weight.outlier_weight)
    return out


@torch.library.register_fake("airserve::w8a8_linear")
def _w8a8_linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _INT8_WEIGHTS[handle].out_features)


def pack_int8(weight: torch.Tensor, outliers: torch.Tensor | None = None,
              weight_bits: int = 8) -> Int8Weight:
    """Quantize a float [N, K] weight to int8 per output channel (symmetric, scale
    max|w|/127; `weight_bits` 7: max|w|/63, and the products then take 8-bit activations) and
    pack it for fbgemm; the caller keeps the result, `w8a8_linear` takes its handle.
    `outliers` (input channels) stay float32: their columns are zero in the int8 weight."""
    if not int8_available():
        raise RuntimeError("torch has no fbgemm engine here: w8a8_int8 is unavailable")
    w = weight.detach().float()
    outlier_weight = None
    if outliers is not None:
        outliers = outliers.to(torch.long).unique()  # sorted, no repeats
        if outliers.numel() and not 0 <= int(outliers[0]) <= int(outliers[-1]) < w.shape[1]:
            raise ValueError(f"outlier channels {outliers.tolist()} outside 0..{w.shape[1] - 1}")
        outlier_weight = w[:, outliers].T.contiguous()
        w = w.index_fill(1, outliers, 0.0)
    if weight_bits not in (7, 8):
        raise ValueError(f"weight_bits={weight_bits}: 7 or 8")
    top = 2 ** (weight_bits - 1) - 1
    scale = (w.abs().amax(1) / top).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-top, top).to(torch.int8)
    with warnings.catch_warnings():  # torch deprecates quantized tensors; fbgemm packs from one
        warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
        qw = torch._make_per_channel_quantized_tensor(
            q, scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0)
    torch.backends.quantized.engine = "fbgemm"
    packed = torch.ops.quantized.linear_prepack(qw, None)
    nbytes = q.numel() + 8 * w.shape[0]
    if outlier_weight is not None:
        nbytes += outlier_weight.numel() * 4 + outliers.numel() * 8
    weight_int8 = Int8Weight(packed, w.shape[0], nbytes, next(_handles), outliers,
                             outlier_weight, weight_bits)
    _INT8_WEIGHTS[weight_int8.handle] = weight_int8
    return weight_int8


# Why float16_weights: benchmark/kernels/bench_matmul_paths.py --candidates f32 f32_onednn fp16w
# float16_weights (2 threads, 2-core AMD EPYC Zen 3, AVX2 + FMA + F16C only, median of 30
# interleaved repeats, GFLOP/s; results/matmul_paths_fp16w_amd_epyc_zen3_avx2.json): at 64 rows,
# merged qkv [576 -> 960] 112 against oneDNN float32's 80, gate_up [576 -> 3072] 112 / 89, down
# [1536 -> 576] 96 / 75, o [576 -> 576] 91 / 85, lm_head [576 -> 49152] 100 / 107; at 16 rows
# 1.1-1.6x; at 512 rows (prefill chunks) 0.95-1.15x. W2 on the same CPU: 1.17x the float32
# path's output rate (README, "Against OpenVINO GenAI: W2").


@dataclass
class Fp16Weight:
    """float16_weights' [N, K] weight: float16 values in fbgemm's packed layout."""

    packed: object  # torch.classes.quantized.LinearPackedParamsBase
    out_features: int
    in_features: int
    handle: int = -1
    in_cpp: bool = False  # registered with the C++ product (fp16_weight_linear_cpp)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2


_FP16_WEIGHTS: weakref.WeakValueDictionary[int, Fp16Weight] = weakref.WeakValueDictionary()

_lib.define("fp16_weight_linear(Tensor x, int handle) -> Tensor")


@torch.library.impl(_lib, "fp16_weight_linear", "CPU")
def _fp16_weight_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic_fp16(x, _FP16_WEIGHTS[handle].packed)


@torch.library.register_fake("airserve::fp16_weight_linear")
def _fp16_weight_linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _FP16_WEIGHTS[handle].out_features)


# The same product in C++ (csrc/packed_or_large.cpp) on the packed weight registered there by
# `pack_fp16`: fbgemm's own call without the Python operator around it (~14 us a call measured
# at one row on the Zen 3 EPYC, ~120 calls a decode step).
_lib.define("fp16_weight_linear_cpp(Tensor x, int handle) -> Tensor")


@torch.library.register_fake("airserve::fp16_weight_linear_cpp")
def _fp16_weight_linear_cpp_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _FP16_WEIGHTS[handle].out_features)


def prepack_fp16(weight: torch.Tensor) -> tuple[object, int, int]:
    """fbgemm's packed float16 form of a float [N, K] weight, and N, K: the slow half of
    `pack_fp16` (~10 ms for a [3072, 576] weight, one core), safe to run on several threads at
    once (fbgemm's packing holds no Python lock and no shared state; `prepack_fp16_many`).
    Raises ValueError for values float16 cannot hold (|w| > 65504: fbgemm would clamp them)."""
    if not int8_available():
        raise RuntimeError("torch has no fbgemm engine here: float16_weights is unavailable; "
                           "use --dtype float32")
    w = weight.detach().float().contiguous()
    big = float(w.abs().max()) if w.numel() else 0.0
    if big > torch.finfo(torch.float16).max:
        raise ValueError(f"weight values up to {big:g} exceed float16's range: use "
                         "--dtype float32 for this model")
    return torch.ops.quantized.linear_prepack_fp16(w, None), w.shape[0], w.shape[1]


def prepack_fp16_many(weights: list[Callable[[], torch.Tensor]], threads: int
                      ) -> list[tuple[object, int, int]]:
    """`prepack_fp16` of each weight (given as a function that makes it, so that at most
    `threads` float32 copies exist at once), on `threads` threads. fbgemm packs on one core,
    so the default model's 121 layers packed in 1.2-1.6 s one after another and 0.6-0.8 s on
    two threads (2-core AMD EPYC, AVX2), a second off every start of the float16_weights
    path. The results are in the order of `weights` and do not depend on `threads`."""
    if threads <= 1 or len(weights) <= 1:
        return [prepack_fp16(make()) for make in weights]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, len(weights)), thread_name_prefix="fp16-pack") as ex:
        return list(ex.map(lambda make: prepack_fp16(make()), weights))


def pack_fp16(weight: torch.Tensor | None = None,
              prepacked: tuple[object, int, int] | None = None) -> Fp16Weight:
    """Round a float [N, K] weight to float16 and pack it for fbgemm (or take `prepack_fp16`'s
    result for it); the caller keeps the result, `fp16_weight_linear` takes its handle."""
    packed, n, k = prepacked if prepacked is not None else prepack_fp16(weight)
    weight_fp16 = Fp16Weight(packed, n, k, next(_handles))
    _FP16_WEIGHTS[weight_fp16.handle] = weight_fp16
    weight_fp16.in_cpp = _register_in_cpp(weight_fp16, torch.ops.airserve_fp16, packed)
    return weight_fp16


def fp16_weight_linear(x: torch.Tensor, weight: Fp16Weight) -> torch.Tensor:
    """x float32 [M, K] (contiguous) -> [M, N] through the float16 `weight` (in C++ where the
    kernels built)."""
    if weight.in_cpp:
        return torch.ops.airserve.fp16_weight_linear_cpp(x, weight.handle)
    return torch.ops.airserve.fp16_weight_linear(x, weight.handle)


# int8_blocks: x float32 [M, K] times the repacked weight, csrc/block_int8_gemm.cpp.
_lib.define("gemm_int8_blocks(Tensor x, Tensor w) -> Tensor")


@torch.library.register_fake("airserve::gemm_int8_blocks")
def _gemm_int8_blocks_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0] * 16)


def pack_int8_blocks(values: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """int8_blocks' weight from Q4_1 blocks: `values` uint8 [N, K/32, 32] (0..15, in K order;
    `PackedWeight.values()`), `d` and `m` [N, K/32] (value = d * q + m). Returns uint8
    [N/16, K/32, 640]: per 16 output columns and block, each half of 8 columns as 8 quads of
    32 bytes (column c's values 4p..4p+3 at byte 4c of quad p), then d and m as float32 [16]
    each (csrc/block_int8_gemm.cpp). Raises ValueError for N not a multiple of 16 or values
    above 15 (the int16 sums of the kernel are sized for 4 bits)."""
    n, nb, block = values.shape
    if block != 32 or n % 16 or tuple(d.shape) != (n, nb) or tuple(m.shape) != (n, nb):
        raise ValueError(f"int8_blocks needs values [N, K/32, 32] with N a multiple of 16 and "
                         f"d, m [N, K/32]; got {tuple(values.shape)}, {tuple(d.shape)}, "
                         f"{tuple(m.shape)}")
    if values.dtype != torch.uint8 or (n and int(values.max()) > 15):
        raise ValueError("int8_blocks multiplies 4-bit values (uint8, 0..15): Q4_1 blocks")
    g = n // 16
    q = (values.view(g, 2, 8, nb, 8, 4)  # [group, half, column, block, quad, 4 values]
         .permute(0, 3, 1, 4, 2, 5).reshape(g, nb, 512))

    def scales(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(g, 16, nb).permute(0, 2, 1).contiguous().view(torch.uint8)

    return torch.cat([q, scales(d), scales(m)], dim=-1).contiguous()


def gemm_int8_blocks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K] (contiguous) -> [M, N] through int8_blocks' weight `w`."""
    return torch.ops.airserve.gemm_int8_blocks(x, w)


def w8a8_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """x float32 [M, K] -> [M, N] through the packed int8 weight `handle`."""
    return torch.ops.airserve.w8a8_linear(x, handle)


@dataclass
class Float32Weight:
    """A [N, K] float32 weight reordered into oneDNN's blocked layout (an opaque mkldnn
    tensor: compiled graphs reach it only through its handle)."""

    packed: torch.Tensor
    out_features: int
    in_features: int
    handle: int = -1

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 4

    def dense(self) -> torch.Tensor:
        """The plain [N, K] float32 weight (a new tensor)."""
        return self.packed.to_dense()


_FLOAT32_WEIGHTS: weakref.WeakValueDictionary[int, Float32Weight] = \
    weakref.WeakValueDictionary()

_lib.define("onednn_linear(Tensor x, int handle) -> Tensor")


@torch.library.impl(_lib, "onednn_linear", "CPU")
def _onednn_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _FLOAT32_WEIGHTS[handle].packed, None,
                                              "none", [], "")


@torch.library.register_fake("airserve::onednn_linear")
def _onednn_linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _FLOAT32_WEIGHTS[handle].out_features)


def onednn_bf16_available() -> bool:
    """Whether oneDNN here multiplies bf16 (natively, or emulated on AVX-512 without bf16)."""
    return onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@dataclass
class Bf16Weight:
    """The bfloat16 path's [N, K] weight, reordered once into oneDNN's blocked layout where
    oneDNN multiplies bf16 (the plain bf16 tensor elsewhere). On the default model's shapes
    the reordered weight multiplies 1.6-1.7x faster than F.linear over the plain one at 64 rows
    and 1.05-1.2x at 512, bit-identical (2 threads, AMD EPYC with avx512_bf16; F.linear lets
    oneDNN reorder the weight on every call).

    A layer fed by outlier input channels also holds its float32 columns at `channels`, and
    the product adds back those channels' bf16 rounding error (x - bf16(x)) in float32
    (path_choice.BF16_RESIDUAL_LAYERS says why). Opaque to compiled graphs, which reach it
    through its handle, like the int8 and float32 oneDNN weights."""

    packed: torch.Tensor  # bf16 [N, K]: an opaque mkldnn tensor when `onednn`
    out_features: int
    in_features: int
    onednn: bool
    handle: int = -1
    channels: torch.Tensor | None = None  # int64 [k], sorted input channels
    residual_weight: torch.Tensor | None = None  # float32 [k, N]: the weight's columns there
    in_cpp: bool = False  # registered with the C++ product (bf16_linear_cpp)

    def dense(self) -> torch.Tensor:
        """The plain bf16 [N, K] weight."""
        return self.packed.to_dense() if self.onednn else self.packed

    @property
    def nbytes(self) -> int:
        n = self.out_features * self.in_features * 2
        if self.channels is not None:
            n += self.residual_weight.numel() * 4 + self.channels.numel() * 8
        return n


_BF16_WEIGHTS: weakref.WeakValueDictionary[int, Bf16Weight] = weakref.WeakValueDictionary()

_lib.define("bf16_linear(Tensor x, int handle) -> Tensor")


@torch.library.impl(_lib, "bf16_linear", "CPU")
def _bf16_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _bf16_product(x, _BF16_WEIGHTS[handle], False)


def _bf16_product(x: torch.Tensor, w: Bf16Weight, keep_bf16: bool) -> torch.Tensor:
    xb = x.to(torch.bfloat16)
    if w.onednn:
        out = torch.ops.mkldnn._linear_pointwise(xb, w.packed, None, "none", [], "")
    else:
        out = F.linear(xb, w.packed)
    if w.channels is None:
        return out if keep_bf16 else out.float()
    out = out.float()
    xs = x.index_select(1, w.channels)
    return out.addmm_(xs - xs.to(torch.bfloat16).float(), w.residual_weight)


@torch.library.register_fake("airserve::bf16_linear")
def _bf16_linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _BF16_WEIGHTS[handle].out_features)


# The same product in C++ (csrc/packed_or_large.cpp) over the weight registered there by
# `pack_bf16`: no Python on the call, which the ~120 products of a decode step pay otherwise.
_lib.define("bf16_linear_cpp(Tensor x, int handle, bool keep_bf16) -> Tensor")


@torch.library.register_fake("airserve::bf16_linear_cpp")
def _bf16_linear_cpp_fake(x: torch.Tensor, handle: int, keep_bf16: bool) -> torch.Tensor:
    w = _BF16_WEIGHTS[handle]
    dtype = torch.bfloat16 if keep_bf16 and w.channels is None else torch.float32
    return x.new_empty(x.shape[0], w.out_features, dtype=dtype)


# The same product for activations that arrive as bf16 (the exact rounding of float32 ones) with
# their rounding error at the weight's residual channels (activation.silu_and_mul_bf16 makes
# both): bf16_linear_cpp's bits without the float32 activations in memory.
_lib.define("bf16_linear_from_bf16(Tensor xb, Tensor err, int handle) -> Tensor")


@torch.library.register_fake("airserve::bf16_linear_from_bf16")
def _bf16_linear_from_bf16_fake(xb: torch.Tensor, err: torch.Tensor,
                                handle: int) -> torch.Tensor:
    return xb.new_empty(xb.shape[0], _BF16_WEIGHTS[handle].out_features, dtype=torch.float32)


# Its float32 <-> bfloat16 conversions (csrc/cpu_common.h), torch's values bit for bit.
_lib.define("cast_to_bf16(Tensor x) -> Tensor")
_lib.define("widen_to_f32(Tensor x) -> Tensor")


@torch.library.register_fake("airserve::cast_to_bf16")
def _cast_to_bf16_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.bfloat16, memory_format=torch.contiguous_format)


@torch.library.register_fake("airserve::widen_to_f32")
def _widen_to_f32_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)


def _register_in_cpp(weight: Bf16Weight | Fp16Weight, store: object, *fields: object) -> bool:
    """Hand `weight` (its handle and `fields`) to a C++ product's store (`store`: the
    operator namespace torch.ops.airserve_bf16 or airserve_fp16), released with `weight`;
    False without the kernels."""
    from airserve.srt.layers import cpu_kernels

    if not cpu_kernels.available():
        return False
    store.register_weight(weight.handle, *fields)
    weakref.finalize(weight, store.release_weight, weight.handle)
    return True


def pack_bf16(weight: torch.Tensor, channels: torch.Tensor | None = None,
              batch_hint: int = ONEDNN_BATCH_HINT) -> Bf16Weight:
    """The bfloat16 path's weight of float32 [N, K] `weight` (with float32 residual columns at
    input `channels`, if given); the caller keeps it, `bf16_linear` takes its handle."""
    w = weight.detach().float()
    onednn = onednn_bf16_available()
    wb = w.bfloat16().contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, batch_hint) if onednn else wb
    residual = None
    if channels is not None:
        channels = channels.to(torch.int64).sort().values
        residual = w[:, channels].t().contiguous()
    weight_bf16 = Bf16Weight(packed, w.shape[0], w.shape[1], onednn, next(_handles), channels,
                             residual)
    _BF16_WEIGHTS[weight_bf16.handle] = weight_bf16
    weight_bf16.in_cpp = _register_in_cpp(weight_bf16, torch.ops.airserve_bf16,
                                          weight_bf16.packed, weight_bf16.onednn,
                                          weight_bf16.channels, weight_bf16.residual_weight)
    return weight_bf16


def bf16_linear(x: torch.Tensor, weight: Bf16Weight, keep_bf16: bool = False) -> torch.Tensor:
    """x float32 (or bfloat16) [M, K] -> float32 [M, N] through the bfloat16 `weight`;
    `keep_bf16`: the product as oneDNN wrote it, bfloat16, unless the weight adds float32
    residual channels (then float32 as always). `keep_bf16` is for eager callers: compiled
    graphs reach the weight through the operator, which widens. Takes the weight, not its
    handle: a compiled graph reads its fields, where the handle's weak map cannot be traced."""
    keep = keep_bf16 and not torch.compiler.is_compiling()
    if weight.in_cpp:
        return torch.ops.airserve.bf16_linear_cpp(x, weight.handle, keep)
    if keep:
        return _bf16_product(x, weight, True)
    return torch.ops.airserve.bf16_linear(x, weight.handle)


def pack_float32(weight: torch.Tensor, batch_hint: int = ONEDNN_BATCH_HINT) -> Float32Weight:
    """Reorder a float32 [N, K] weight for oneDNN's matmul (laid out for inputs of about
    `batch_hint` rows); the caller keeps the result, `onednn_linear` takes its handle."""
    if not onednn_available():
        raise RuntimeError("torch has no oneDNN (mkldnn) here: --cpu-float32-matmul onednn "
                           "is unavailable")
    w = weight.detach().float().contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
    weight_f32 = Float32Weight(packed, w.shape[0], w.shape[1], next(_handles))
    _FLOAT32_WEIGHTS[weight_f32.handle] = weight_f32
    return weight_f32


def onednn_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """x float32 [M, K] (contiguous) -> [M, N] through the reordered weight `handle`."""
    return torch.ops.airserve.onednn_linear(x, handle)
