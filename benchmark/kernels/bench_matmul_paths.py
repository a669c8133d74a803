"""Per-shape timings of every CPU matmul path airserve could use for prefill and large batches.

Shapes are the default model's (SmolLM2-135M): (K, N) = (576, 576) q/o, (576, 192) k/v,
(576, 1536) gate/up, (1536, 576) down, merged qkv (576, 960) and gate_up (576, 3072), and the
lm_head (576, 49152) (Q8_0; only up to 256 rows: a step computes it for one token per request).
The weight is a random Q4_1 (lm_head: Q8_0) weight, dequantized, so every path multiplies the
same values. Candidates, all interleaved in one loop (each repeat times every candidate once,
so a busy machine slows all alike), medians reported:

  f32            F.linear in float32 (MKL sgemm): --cpu-float32-matmul sgemm
  f32_onednn     airserve's float32 path by oneDNN over the weight reordered once
                 (--cpu-float32-matmul onednn, matmul_paths.ONEDNN_BATCH_HINT)
  onednn_h<B>    the same with the weight reordered for batch hint B (--onednn-hints B ...)
  bf16           F.linear with bf16 activations and weights (what --dtype bfloat16 runs)
  f32_bf16w      x cast to bf16, bf16 F.linear, result cast back (a bf16 path in a float32 model)
  fp16w          fbgemm: fp16 weights, float32 arithmetic (quantized::linear_dynamic_fp16)
  float16_weights  airserve's --quantization float16_weights (fp16w through its operator)
  int8pack       torch._weight_int8pack_mm: float32 x, int8 per-channel weights
  fbgemm_int8    quantized::linear_dynamic, fbgemm engine: u8 activations per tensor (dynamic,
                 reduce_range), s8 per-channel weights
  onednn_int8    the same op with the onednn engine
  w8a8_int8      airserve's --quantization w8a8_int8 (fbgemm_int8 with per-token activation
                 scales: Linear.set_large_path)
  w8a8_int8_outliers  airserve's --quantization w8a8_int8_outliers: w8a8_int8 with 16 input
                 channels (evenly spaced here; calibrated in the server) multiplied in float32
  torchao_int8   torchao Int8DynamicActivationInt8WeightConfig (per-token int8), eager
  int8_blocks    airserve's int8_blocks (--cpu-large-activations): the Q4_1 blocks repacked,
                 int8 activations per block of 32, one call for all rows (Q4_1 shapes only)
  block_int8     airserve's block kernels, int8 activations per block of 32, 16 rows a call
  block_f32      airserve's block kernels, float32 activations, 16 rows a call

Each row also gives the relative error of the product against float64 (Frobenius norm).

    python benchmark/kernels/bench_matmul_paths.py [--rows 16 64 256 1024 2048] [--json F]
    python benchmark/kernels/bench_matmul_paths.py --candidates f32 f32_onednn \
        --onednn-hints 16 256 --rows 9 16 32 64 128 512 2048     # float32 implementations
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_kernels import cpu_info, make_weight

SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 960), (576, 3072),
          (576, 49152))
LM_HEAD_MAX_ROWS = 256
CANDIDATES = ("f32", "f32_onednn", "bf16", "f32_bf16w", "fp16w", "float16_weights", "int8pack",
              "fbgemm_int8", "onednn_int8", "w8a8_int8", "w8a8_int8_outliers", "torchao_int8",
              "int8_blocks", "block_int8", "block_f32")


def _per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def _quantized_linear(w: torch.Tensor, engine: str) -> Callable | None:
    if engine not in torch.backends.quantized.supported_engines:
        return None
    torch.backends.quantized.engine = engine
    q8, scale = _per_channel_int8(w)
    qw = torch._make_per_channel_quantized_tensor(q8, scale.double(),
                                                  torch.zeros_like(scale, dtype=torch.long), 0)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    reduce_range = engine == "fbgemm"  # u8 x s8 pairs must not saturate AVX2's int16 adds

    def run(x: torch.Tensor) -> torch.Tensor:
        torch.backends.quantized.engine = engine
        return torch.ops.quantized.linear_dynamic(x, packed, reduce_range)

    return run


def _fp16_weight_linear(w: torch.Tensor) -> Callable | None:
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    torch.backends.quantized.engine = "fbgemm"
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)

    def run(x: torch.Tensor) -> torch.Tensor:
        torch.backends.quantized.engine = "fbgemm"
        return torch.ops.quantized.linear_dynamic_fp16(x, packed)

    return run


def _torchao_linear(w: torch.Tensor) -> Callable | None:
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        return None
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data = w.clone()
    quantize_(lin, Int8DynamicActivationInt8WeightConfig())
    return lin


def _airserve_path(w: torch.Tensor, path: str, float32_impl: str = "sgemm") -> Callable:
    from airserve.srt.layers.linear import Linear
    from airserve.srt.layers.quant.matmul_paths import DEFAULT_OUTLIER_CHANNELS

    layer = Linear(w.shape[1], w.shape[0], bias=False)
    layer.weight.data = w.clone()
    k = w.shape[1]
    outliers = (torch.arange(DEFAULT_OUTLIER_CHANNELS) * (k // DEFAULT_OUTLIER_CHANNELS)
                if path == "w8a8_int8_outliers" else None)
    layer.set_large_path(path, float32_impl=float32_impl, outliers=outliers)
    return layer


def _onednn_hint(w: torch.Tensor, hint: int) -> Callable | None:
    from airserve.srt.layers.quant.matmul_paths import onednn_available, pack_float32

    if not onednn_available():
        return None
    packed = pack_float32(w, hint)
    return lambda x: torch.ops.airserve.onednn_linear(x, packed.handle)


def _int8_blocks(packed) -> Callable:
    from airserve.srt.layers.quant.matmul_paths import gemm_int8_blocks, pack_int8_blocks

    w = pack_int8_blocks(packed.values(), packed.d, packed.m)
    return lambda x: gemm_int8_blocks(x, w)


def _blocks(packed, activations: str) -> Callable:
    from airserve.srt.layers.quant.block_matvec import MAX_ROWS, packed_linear

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([packed_linear(x[i:i + MAX_ROWS].contiguous(), packed, activations)
                          for i in range(0, x.shape[0], MAX_ROWS)])

    return run


def build(k: int, n: int, names: list[str]) -> tuple[torch.Tensor, dict[str, Callable]]:
    """The shape's weight (float32 [N, K]) and each candidate's `x -> x @ w.T` (float32 x)."""
    packed = make_weight("Q8_0" if n > 4096 else "Q4_1", n, k)
    w = packed.dequantize()
    wb = w.bfloat16()
    fns: dict[str, Callable | None] = {
        "f32": lambda x: F.linear(x, w),
        "f32_onednn": (_airserve_path(w, "float32", "onednn")
                       if "f32_onednn" in names and torch.backends.mkldnn.is_available()
                       else None),
        "bf16": lambda x: F.linear(x, wb),  # x is given in bf16 (see time_shape)
        "f32_bf16w": lambda x: F.linear(x.bfloat16(), wb).float(),
        "fp16w": _fp16_weight_linear(w),
        "float16_weights": (_airserve_path(w, "float16_weights")
                            if "float16_weights" in names else None),
        "int8pack": (lambda q, s: lambda x: torch._weight_int8pack_mm(x, q, s))(
            *_per_channel_int8(w)),
        "fbgemm_int8": _quantized_linear(w, "fbgemm"),
        "onednn_int8": _quantized_linear(w, "onednn"),
        "w8a8_int8": _airserve_path(w, "w8a8_int8") if "w8a8_int8" in names else None,
        "w8a8_int8_outliers": (_airserve_path(w, "w8a8_int8_outliers")
                               if "w8a8_int8_outliers" in names else None),
        "torchao_int8": _torchao_linear(w) if "torchao_int8" in names else None,
        "int8_blocks": (_int8_blocks(packed)
                        if "int8_blocks" in names and packed.kind == "q4_1" else None),
        "block_int8": _blocks(packed, "int8"),
        "block_f32": _blocks(packed, "float32"),
    }
    for name in names:
        if name.startswith("onednn_h"):
            fns[name] = _onednn_hint(w, int(name.removeprefix("onednn_h")))
    return w, {name: fns[name] for name in names if fns.get(name) is not None}


def time_shape(k: int, n: int, m: int, fns: dict[str, Callable], w: torch.Tensor,
               repeats: int) -> dict:
    x = torch.randn(m, k)
    xb = x.bfloat16()
    ref = (x.double() @ w.double().T)
    inputs = {name: xb if name == "bf16" else x for name in fns}
    row = {"M": m, "K": k, "N": n}
    for name, fn in fns.items():  # warm-up and error
        out = fn(inputs[name]).double()
        row[f"{name}_relerr"] = ((out - ref).norm() / ref.norm()).item()
        fn(inputs[name])
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(inputs[name])
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        row[f"{name}_gflops"] = 2 * m * k * n / statistics.median(ts) / 1e9
    return row


def print_row(row: dict, names: list[str]) -> None:
    cells = " ".join(f"{row.get(f'{n}_gflops', float('nan')):>12.1f}" for n in names)
    best = max(names, key=lambda n: row.get(f"{n}_gflops", 0))
    print(f"{row['M']:5d} {row['K']:5d} {row['N']:6d} {cells}  {best}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 1024, 2048])
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    p.add_argument("--onednn-hints", type=int, nargs="*", default=[],
                   help="also time oneDNN float32 with the weight reordered for these batch "
                        "hints (candidates onednn_h<B>)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", message=".*quantized tensor creation.*")
    from airserve.srt.layers.quant import block_matvec

    names = list(a.candidates) + [f"onednn_h{b}" for b in a.onednn_hints]
    if not block_matvec.kernels_available():
        print(f"airserve's block kernels did not build ({block_matvec.unavailable_reason()})")
        names = [n for n in names if not n.startswith("block_")]
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}; features: {' '.join(cpu['features'])}; threads {a.threads}; "
          f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}; "
          f"quantized engines {torch.backends.quantized.supported_engines}")
    print("GFLOP/s (median of interleaved repeats)")
    print(f"{'M':>5} {'K':>5} {'N':>6} " + " ".join(f"{n:>12}" for n in names) + "  best")
    rows = []
    with torch.inference_mode():
        for k, n in SHAPES:
            w, fns = build(k, n, names)
            for m in a.rows:
                if n > 4096 and m > LM_HEAD_MAX_ROWS:
                    continue
                rows.append(time_shape(k, n, m, fns, w, a.repeats))
                print_row(rows[-1], names)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu, "threads": a.threads, "torch": torch.__version__,
                       "candidates": names, "repeats": a.repeats,
                       "note": "GFLOP/s, median of interleaved repeats; relerr vs float64",
                       "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
