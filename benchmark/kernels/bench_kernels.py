"""Micro-benchmark of the packed decode kernels: float32 vs int8 activations per GGUF type.

Shapes are the default model's (SmolLM2-135M): [N, K] = [1536, 576] (gate/up), [576, 1536]
(down) and [49152, 576] (lm_head); K-quants need K a multiple of 256, so they run on the down
shape only. Weights are random normal values quantized to each type. Prints a table (median
microseconds per product, weight GB/s) and writes JSON; names the CPU and its features. On a
shared machine the figures are noisy: compare columns of one run, not runs.

    python benchmark/kernels/bench_kernels.py [--rows 1 2 4 8] [--threads 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from airserve.srt.hardware import host_cpu

SHAPES = ((1536, 576), (576, 1536), (49152, 576))
TYPES = ("Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
            "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def cpu_info() -> dict:
    """CPU model name and the features that matter to these kernels."""
    model, flags = host_cpu()
    return {"model": model, "features": [f for f in FEATURES if f in flags]}


def make_weight(type_name: str, n: int, k: int):
    from gguf import GGMLQuantizationType

    from airserve.srt.layers.quant.block_matvec import PackedWeight
    from airserve.srt.model_loader.gguf_dequant import pack_blocks
    from airserve.srt.model_loader.gguf_quantize import quantize

    w = np.random.default_rng(0).normal(0, 0.02, size=(n, k)).astype(np.float32)
    kind, *parts = pack_blocks(quantize(w, type_name).reshape(-1),
                               int(GGMLQuantizationType[type_name]), (n, k))
    qs, d, m = (None if a is None else torch.from_numpy(np.array(a)) for a in parts)
    return PackedWeight(kind, qs, d, m)


def time_us(fn, repeats: int) -> float:
    """Median microseconds of `repeats` calls after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def run(rows: list[int], types: list[str], repeats: int, isas: list[str]) -> list[dict]:
    from airserve.srt.layers.quant.block_matvec import packed_linear, use_int8_isa

    results = []
    for type_name in types:
        for n, k in SHAPES:
            if type_name.endswith("_K") and k % 256:
                continue
            w = make_weight(type_name, n, k)
            for m in rows:
                x = torch.randn(m, k)
                row = {"type": type_name, "N": n, "K": k, "rows": m, "weight_bytes": w.nbytes,
                       "float32_us": time_us(lambda x=x, w=w: packed_linear(x, w), repeats)}
                for isa in isas:
                    use_int8_isa(isa)
                    row[f"int8_{isa}_us"] = time_us(
                        lambda x=x, w=w: packed_linear(x, w, "int8"), repeats)
                use_int8_isa("auto")
                results.append(row)
                print_row(row, isas)
    return results


def print_header(isas: list[str]) -> None:
    cols = "".join(f" {'int8 ' + i:>17}" for i in isas)
    print(f"{'type':5} {'N':>6} {'K':>5} {'rows':>4} {'float32 us':>11}{cols} {'speed-up':>8}"
          f" {'GB/s int8':>9}")


def print_row(r: dict, isas: list[str]) -> None:
    best = r[f"int8_{isas[0]}_us"]
    cols = "".join(f" {r[f'int8_{i}_us']:17.1f}" for i in isas)
    print(f"{r['type']:5} {r['N']:6d} {r['K']:5d} {r['rows']:4d} {r['float32_us']:11.1f}{cols}"
          f" {r['float32_us'] / best:7.2f}x {r['weight_bytes'] / best / 1e3:9.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--types", nargs="+", default=list(TYPES))
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--all-isas", action="store_true",
                   help="int8 on every instruction set this CPU has (default: the best)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from airserve.srt.layers.quant import block_matvec

    if not block_matvec.kernels_available():
        raise SystemExit(f"the packed kernels did not build: {block_matvec.unavailable_reason()}")
    cpu = cpu_info()
    isas = block_matvec.int8_isas() if a.all_isas else block_matvec.int8_isas()[:1]
    print(f"CPU: {cpu['model']}; features: {' '.join(cpu['features'])}; threads {a.threads}; "
          f"int8 instruction sets: {', '.join(block_matvec.int8_isas())}")
    print_header(isas)
    results = run(a.rows, a.types, a.repeats, isas)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu, "threads": a.threads, "int8_isas": block_matvec.int8_isas(),
                       "note": "median of repeats; shared machine: figures are noisy",
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
