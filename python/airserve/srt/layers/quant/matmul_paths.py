"""How a linear layer multiplies inputs above the packed decode limit (prefill, large batches).

Small decode batches multiply with the GGUF blocks as stored (`block_matvec`); they are
bandwidth-bound. Larger inputs are compute-bound, and the fastest way to multiply them depends
on the CPU. A layer holds the weight form of one of these paths (`Linear.set_large_path`):

  float32    F.linear over float32 weights (oneDNN/MKL sgemm). Exact; always available.
  bfloat16   F.linear with bf16 weights and activations cast to bf16 per product, result cast
             back to float32 (oneDNN; avx512_bf16 or AMX make it ~2-3x float32; without them
             oneDNN emulates bf16 and it is slower than float32, so it is refused there).
             down_proj layers stay float32 (FLOAT32_LAYERS).
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
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

PATHS = ("float32", "bfloat16", "w8a8_int8", "w8a8_int8_outliers")
INT8_PATHS = ("w8a8_int8", "w8a8_int8_outliers")  # fbgemm products (airserve::w8a8_linear)
FLOAT32_IMPLS = ("onednn", "sgemm")
QUANTIZATIONS = INT8_PATHS  # --quantization values; None: the path follows --dtype
# Input channels per layer that w8a8_int8_outliers keeps in float32 (--int8-outlier-channels).
DEFAULT_OUTLIER_CHANNELS = 16
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 dot products
# Layers a path leaves on float32, by the last part of their module name (FIDELITY's note says
# why bf16 keeps down_proj).
FLOAT32_LAYERS: dict[str, tuple[str, ...]] = {"bfloat16": ("down_proj",)}

# Fidelity of each path against float32 on the default model (Q4_1), teacher-forced prefill of
# 1,992 scored tokens of the packaged text: benchmark/kernels/fidelity.py --paths (pass: top-1
# agreement >= 98% and perplexity within 1%; measured on an AVX2 CPU, where oneDNN emulates
# bf16 with the same rounding). `auto` picks only paths marked passed here
# (test/srt/layers/test_matmul_paths.py). w8a8_int8 fails far off: one scale per token cannot
# serve this model's outlier activation channels (7-bit steps sized by the outliers).
# `auto` also needs "answers": the default model's answer to the README's chat example ("What
# is the capital of France?") equal to float32's (test/models/test_default_model_answers.py).
# bf16 in every layer passed the bar (98.59% / +0.33% with oneDNN's emulated bf16 on AVX2;
# 98.19% / +0.19% native on an AMD EPYC with avx512_bf16) but not that: its prefill turned the
# first answer token from "The" into "L'" ("L'Étoile, la Cité, ..."), and the model never said
# Paris. A probe on that machine kept one kind of layer in float32 at a time: down_proj (fed by
# the gated MLP activations, the model's outlier channels) or q/k/v in float32 restored the
# answer, gate/up or the lm_head did not. down_proj is the cheaper of the two (a fifth of the
# flops per token), so the bfloat16 path keeps it in float32 (`FLOAT32_LAYERS`).
FIDELITY = {
    "float32": {"passed": True},  # the reference (exact)
    # down_proj in float32 (FLOAT32_LAYERS); native bf16, AMD EPYC with avx512_bf16.
    "bfloat16": {"passed": True, "top1_agreement": 0.9844, "ppl_change": 0.0011},
    "w8a8_int8": {"passed": False, "top1_agreement": 0.8243, "ppl_change": 0.1274},
    # 16 outlier channels per layer (the default), 8-bit activations, 7-bit weights; other
    # variants (more channels, lm_head float32, SmoothQuant scales) in the README: none passed.
    "w8a8_int8_outliers": {"passed": False, "top1_agreement": 0.9523, "ppl_change": 0.0068},
}


# The batch size oneDNN lays the reordered weight out for. On the default model's shapes
# (benchmark/kernels/bench_matmul_paths.py --onednn-hints, 2 threads, AVX2 EPYC) hints of 16,
# 64, 256 and 1024 differed by less than the noise of the shared machine at M = 9..2048
# (results/matmul_float32_onednn_hints_amd_epyc_avx2.json), all ahead of sgemm in most rows;
# 64 (the W2 decode batch) stays.
ONEDNN_BATCH_HINT = 64


def onednn_available() -> bool:
    """Whether this torch has oneDNN (mkldnn) for CPU matmuls."""
    return torch.backends.mkldnn.is_available()


def choose_float32_impl(requested: str) -> str:
    """The float32 implementation for --cpu-float32-matmul `requested` ("auto", or one of
    `FLOAT32_IMPLS`). Raises ValueError naming the flag when oneDNN is requested but absent."""
    if requested == "auto":
        return "onednn" if onednn_available() else "sgemm"
    if requested not in FLOAT32_IMPLS:
        raise ValueError(f"cpu_float32_matmul={requested!r}: choose auto or one of "
                         f"{', '.join(FLOAT32_IMPLS)}")
    if requested == "onednn" and not onednn_available():
        raise ValueError("--cpu-float32-matmul onednn: this torch has no oneDNN (mkldnn) CPU "
                         "backend; use --cpu-float32-matmul sgemm (or auto)")
    return requested


def cpu_has_bf16(flags: frozenset[str]) -> bool:
    return any(f in flags for f in BF16_FLAGS)


def int8_available() -> bool:
    """Whether torch has fbgemm here (x86 with AVX2 or better)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def choose_large_path(dtype: str, quantization: str | None, flags: frozenset[str]) -> str:
    """The path of products above the packed limit for --dtype, --quantization and a CPU with
    `flags`. Raises ValueError naming the fix when the CPU cannot run the requested path."""
    if quantization in INT8_PATHS:
        if not int8_available():
            raise ValueError(f"--quantization {quantization} needs torch's fbgemm int8 kernels "
                             "(an x86 CPU with AVX2); this torch has none: drop --quantization")
        return quantization
    if quantization is not None:
        raise ValueError(f"--quantization {quantization}: choose one of {QUANTIZATIONS}")
    if dtype == "bfloat16":
        if not cpu_has_bf16(flags):
            raise ValueError("--dtype bfloat16 on this CPU: it has no bf16 dot products "
                             f"({' or '.join(BF16_FLAGS)}), so bf16 matmuls would run slower "
                             "than float32; use --dtype float32 (or auto)")
        return "bfloat16"
    if dtype in ("float32", "float16"):
        return "float32"
    return auto_path(flags)


def auto_path(flags: frozenset[str]) -> str:
    """The fastest path on a CPU with `flags` among those whose fidelity passed."""
    ranked = ["bfloat16"] if cpu_has_bf16(flags) else []
    if int8_available():
        ranked += ["w8a8_int8", "w8a8_int8_outliers"]
    ranked.append("float32")
    return next(p for p in ranked if auto_eligible(p))


def layer_path(name: str, path: str) -> str:
    """The large path of the layer with module name `name` in a model whose path is `path`."""
    return "float32" if name.rsplit(".", 1)[-1] in FLOAT32_LAYERS.get(path, ()) else path


def auto_eligible(path: str) -> bool:
    """Whether `auto` may pick `path`: its fidelity passed and the default model still answers
    the README's example as float32 does (FIDELITY)."""
    return FIDELITY[path]["passed"] and FIDELITY[path].get("answers", True)


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
