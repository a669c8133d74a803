"""Which matmul path (layers/quant/matmul_paths.py) a layer takes for prefill and large
batches, from --dtype, --quantization and --cpu-float32-matmul on a CPU with given flags.

Without torch at import: the HTTP process checks the flags with it and never loads a model.
Only the probes of torch's CPU backends (`onednn_available`, `int8_available`) import torch,
and the flags call them only when they need them.
"""

from __future__ import annotations

PATHS = ("float32", "bfloat16", "float16_weights", "w8a8_int8", "w8a8_int8_outliers")
# --cpu-large-activations: which Q4_1 layers take matmul_paths' int8_blocks for their decode
# batches above the packed limit and extend rows (ServerArgs says what each value means).
LARGE_ACTIVATIONS = ("auto", "int8", "float")
# The Q4_1 layers (by role) that --cpu-large-activations auto gives int8_blocks beside
# float16_weights: their decode batches above the packed limit and their extend rows but those
# whose logits are read. 2-core AMD EPYC Zen 3 (AVX2 only); pass at top-1 >= 98% and perplexity
# within 1% of float32.
# - Decode batches, the large-decode check (`fidelity.py --large-decode-int8-roles ... --batch
#   16`: 1,984 tokens decoded teacher-forced 16 rows a step): float16_weights alone 99.80%,
#   + int8 in gate/up 98.29% / +0.20%, gate/up + down 98.19% / +0.12%, + o 97.93% (fails)
#   (benchmark/kernels/results/fidelity_large_decode_int8_amd_epyc_zen3_avx2.json).
# - Extends, bounded by the prefill check with int8 in every row, the rows whose logits are read
#   too (`fidelity.py --paths` on a build that allowed it): gate/up 98.85% / +0.05%, gate/up +
#   down 99.15% / +0.16%, + o 98.85%, every Q4_1 layer 97.89% (fails)
#   (results/fidelity_paths_int8_prefill_*_amd_epyc_zen3_avx2.json). That build turned the
#   default model's chat answer into "L'Étoile, la Marseillaise, ..." (gate/up alone already);
#   the last row alone on float16_weights gave "The capital of France is Paris." back, which is
#   why the rows whose logits are read keep the large path (test_default_model.py).
# - Speed: int8_blocks' product is ~2x float16_weights' at 9-512 rows (bench_matmul_paths.py);
#   W2 figures in the README ("Prefill and large batches").
# The decode margin is thin (0.2 points), so only these two roles, and not at the model's ends
# (AUTO_LARGE_INT8_EDGE_DIVISOR).
AUTO_LARGE_INT8_ROLES = frozenset({"gate_up_proj", "down_proj"})
# Under auto, the first and last n_layers // AUTO_LARGE_INT8_EDGE_DIVISOR decoder layers keep
# the large path's arithmetic in those roles too. Why: the int8 products' relative error per
# layer (int8_blocks against float16_weights on the same inputs, 480 tokens of the packaged
# text, 16 rows a step) is ~0.7% in most layers and highest at the ends (down_proj of layer 28
# 1.5%, gate/up of layer 0 1.1%), and the large-decode check above, same CPU, gate/up + down
# with int8 everywhere but the first and last k layers: k = 0 98.19% / +0.12%, 1 98.44%, 2
# 98.79% / +0.03%, 3 98.89% / +0.14%, 4 99.14% / +0.10%
# (benchmark/kernels/results/fidelity_large_decode_int8_edges_amd_epyc_zen3_avx2.json). k = 3
# (n // 8 of the default model's 30 layers) keeps 48 of its 60 int8 layers and a 0.9-point
# margin. llama.cpp's Q4_K_M mix likewise gives more bits to ffn_down in the first and last
# eighth of the layers (and every third layer between: use_more_bits in src/llama-quant.cpp).
AUTO_LARGE_INT8_EDGE_DIVISOR = 8


def check_large_activations(setting: str) -> None:
    """Raise ValueError naming the flag for a --cpu-large-activations value not in
    LARGE_ACTIVATIONS."""
    if setting not in LARGE_ACTIVATIONS:
        raise ValueError(f"cpu_large_activations={setting!r}: choose one of "
                         f"{', '.join(LARGE_ACTIVATIONS)}")


def auto_large_int8_layer(index: int | None, n_layers: int) -> bool:
    """Whether decoder layer `index` of `n_layers` (None: a layer outside the decoder stack)
    is one where --cpu-large-activations auto may take int8_blocks: not in the first or last
    n_layers // AUTO_LARGE_INT8_EDGE_DIVISOR layers, nor outside the stack."""
    if index is None:
        return False
    edge = n_layers // AUTO_LARGE_INT8_EDGE_DIVISOR
    return edge <= index < n_layers - edge


INT8_PATHS = ("w8a8_int8", "w8a8_int8_outliers")  # fbgemm products (airserve::w8a8_linear)
# fbgemm's products (x86 with AVX2 or better): the int8 paths and float16 weights.
FBGEMM_PATHS = ("float16_weights",) + INT8_PATHS
FLOAT32_IMPLS = ("onednn", "sgemm")
QUANTIZATIONS = FBGEMM_PATHS  # --quantization values; None: the path follows --dtype
# The inexact paths beside which `auto` keeps the KV pool in float16 on cpu
# (ServerArgs.resolved_kv_cache_dtype; benchmark/kernels/fidelity.py --kv-cache-dtypes checks
# the pair).
FLOAT16_KV_PATHS = ("bfloat16", "float16_weights")
# Not int8 beside float16_weights, though alone it passes there (98.69% top-1, +0.08%, Zen 3
# EPYC: benchmark/kernels/results/fidelity_kv_int8_float16_weights_amd_epyc_zen3_avx2.json) and
# its decode attention is faster (17.0 against 23.4 ms a 64-row step): with it under the default
# int8 decode activations (block_matvec.AUTO_INT8_ROLES) the decode check fell to 97.89% on the
# default file and 97.79% on a Q4_K_M mix (test_fidelity.py), below the 98% bar.
# Input channels per layer that w8a8_int8_outliers keeps in float32 (--int8-outlier-channels).
DEFAULT_OUTLIER_CHANNELS = 16
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 dot products
# Layers the bfloat16 path multiplies with float32 residual columns, by the last part of their
# module name, and how many input channels each (found at load by a calibration prefill:
# quant.int8_calibration). FIDELITY's note says why.
BF16_RESIDUAL_LAYERS = ("down_proj",)
BF16_RESIDUAL_CHANNELS = 16

# Fidelity of each path against float32 on the default model (Q4_1), teacher-forced prefill of
# 1,992 scored tokens of the packaged text: benchmark/kernels/fidelity.py --paths (pass: top-1
# agreement >= 98% and perplexity within 1%; measured on an AVX2 CPU, where oneDNN emulates
# bf16 with the same rounding). `auto` picks only paths marked passed here
# (test/srt/layers/test_matmul_paths.py). w8a8_int8 fails far off: one scale per token cannot
# serve this model's outlier activation channels (7-bit steps sized by the outliers).
# `auto` also needs "answers": the default model's answer to the README's chat example ("What
# is the capital of France?") equal to float32's (test/srt/models/test_default_model.py).
# bf16 in every layer passed the bar (98.59% / +0.33% with oneDNN's emulated bf16 on AVX2;
# 98.19% / +0.19% native on an AMD EPYC with avx512_bf16) but not that: its prefill turned the
# first answer token from "The" into "L'" ("L'Étoile, la Cité, ..."), and the model never said
# Paris. Probes on that machine: down_proj (fed by the gated MLP activations, the model's
# outlier channels) or q/k/v in float32 restored the answer, gate/up or the lm_head did not;
# down_proj in bf16 with either its weights alone or its activations alone rounded did not;
# down_proj in bf16 with the rounding error of its 4, 8, 16 or 32 largest calibrated input
# channels added back in float32 did. The last costs a [rows, 16] x [16, 576] product per
# layer instead of a float32 down_proj (a fifth of the flops per token, and the slowest
# product of a bs-64 decode step in float32), so it is the bfloat16 path
# (`BF16_RESIDUAL_LAYERS`, `BF16_RESIDUAL_CHANNELS`).
FIDELITY = {
    "float32": {"passed": True},  # the reference (exact)
    # down_proj with 16 residual channels; native bf16, AMD EPYC with avx512_bf16, with the C++
    # prefill attention (98.29%, +0.20% before it; 98.19%, +0.06% before the C++ ops of eager
    # passes: last-bit changes upstream of a bf16 rounding move this path's figures by
    # ~0.1-0.3 points either way).
    "bfloat16": {"passed": True, "top1_agreement": 0.9854, "ppl_change": 0.0012},
    # The weights' float16 rounding only: 100.00% / +0.01% on a Zen 3 EPYC (AVX2), 1,992 tokens
    # (benchmark/kernels/results/fidelity_paths_float16_weights_amd_epyc_zen3_avx2.json).
    "float16_weights": {"passed": True, "top1_agreement": 1.0, "ppl_change": 0.0001},
    "w8a8_int8": {"passed": False, "top1_agreement": 0.8243, "ppl_change": 0.1274},
    # 16 outlier channels per layer (the default), 8-bit activations, 7-bit weights; other
    # variants (more channels, lm_head float32, SmoothQuant scales) in the README: none passed.
    "w8a8_int8_outliers": {"passed": False, "top1_agreement": 0.9523, "ppl_change": 0.0068},
}



def onednn_available() -> bool:
    """Whether this torch has oneDNN (mkldnn) for CPU matmuls."""
    import torch

    return torch.backends.mkldnn.is_available()


def check_float32_impl(requested: str) -> None:
    """Raise ValueError naming the flag for a --cpu-float32-matmul value this torch cannot run;
    probes torch only for an explicit "onednn"."""
    if requested != "auto":
        choose_float32_impl(requested)


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


def fbgemm_cpu(flags: frozenset[str]) -> bool:
    """Whether fbgemm's kernels run here, from the CPU alone (no torch import: the HTTP process
    resolves `auto` too): an x86-64 CPU with AVX2 and FMA. torch's x86 builds carry fbgemm
    (`int8_available` asks torch itself; the paths' weights are packed through it and raise
    naming the flag where it is missing)."""
    import platform

    return (platform.machine().lower() in ("x86_64", "amd64")
            and {"avx2", "fma"} <= set(flags))


def int8_available() -> bool:
    """Whether torch has fbgemm here (x86 with AVX2 or better): the int8 paths and float16
    weights."""
    import torch

    return "fbgemm" in torch.backends.quantized.supported_engines


def choose_large_path(dtype: str, quantization: str | None, flags: frozenset[str]) -> str:
    """The path of products above the packed limit for --dtype, --quantization and a CPU with
    `flags`. Raises ValueError naming the fix when the CPU cannot run the requested path."""
    if quantization in FBGEMM_PATHS:
        if not int8_available():
            raise ValueError(f"--quantization {quantization} needs torch's fbgemm kernels "
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
    if fbgemm_cpu(flags):
        ranked += [p for p in FBGEMM_PATHS if auto_eligible(p)]
    ranked.append("float32")
    return next(p for p in ranked if auto_eligible(p))


def auto_eligible(path: str) -> bool:
    """Whether `auto` may pick `path`: its fidelity passed and the default model still answers
    the README's example as float32 does (FIDELITY)."""
    return FIDELITY[path]["passed"] and FIDELITY[path].get("answers", True)
