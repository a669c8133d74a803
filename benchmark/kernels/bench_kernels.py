"""Micro-benchmark of the packed decode kernels: float32 vs int8 activations per GGUF type
(and int16 activations for the kinds that have them: Q4_1, Q4_K, Q6_K).

Shapes are the default model's (SmolLM2-135M): [N, K] = [1536, 576] (gate/up), [576, 1536]
(down) and [49152, 576] (lm_head); K-quants need K a multiple of 256, so they run on the down
shape only. Weights are random normal values quantized to each type. Prints a table (median
microseconds per product, weight GB/s of float32 and of the best int8) and writes JSON; names
the CPU and its features. The float32 products run on the best instruction set this CPU has
and on plain C++, the int8 ones on the best (`--all-isas`: every one); the configurations
take turns call by call. On a shared machine the figures are noisy: compare columns of one
run, not runs.

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


def time_interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each fn, after two warm-up calls each. The fns take
    turns call by call, so a busy machine's slow spells hit them alike."""
    for fn in fns.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def with_isa(fn, select, isa):
    """fn, called with the instruction set `isa` selected (select: use_*_isa)."""
    def call():
        select(isa)
        return fn()
    return call


def run(rows: list[int], types: list[str], repeats: int, isas: list[str],
        f32_isas: list[str]) -> list[dict]:
    from airserve.srt.layers.quant.block_matvec import (
        INT16_KINDS,
        packed_linear,
        use_float32_isa,
        use_int8_isa,
    )

    results = []
    for type_name in types:
        for n, k in SHAPES:
            if type_name.endswith("_K") and k % 256:
                continue
            w = make_weight(type_name, n, k)
            for m in rows:
                x = torch.randn(m, k)
                f32 = lambda x=x, w=w: packed_linear(x, w)  # noqa: E731
                i8 = lambda x=x, w=w: packed_linear(x, w, "int8")  # noqa: E731
                fns = {f"float32_{i}_us": with_isa(f32, use_float32_isa, i) for i in f32_isas}
                fns.update({f"int8_{i}_us": with_isa(i8, use_int8_isa, i) for i in isas})
                if w.kind in INT16_KINDS:  # int16 activations (csrc/block_int16*.cpp)
                    fns["int16_us"] = lambda x=x, w=w: packed_linear(x, w, "int16")
                row = {"type": type_name, "N": n, "K": k, "rows": m, "weight_bytes": w.nbytes,
                       **time_interleaved(fns, repeats)}
                row["float32_us"] = row[f"float32_{f32_isas[0]}_us"]
                use_int8_isa("auto")
                use_float32_isa("auto")
                results.append(row)
                print_row(row, isas, f32_isas)
    return results


def print_header(isas: list[str], f32_isas: list[str]) -> None:
    cols = "".join(f" {'float32 ' + i:>15}" for i in f32_isas)
    cols += "".join(f" {'int8 ' + i:>17}" for i in isas)
    print(f"{'type':5} {'N':>6} {'K':>5} {'rows':>4}{cols} {'int16':>8} {'int8 gain':>9}"
          f" {'GB/s f32':>8} {'GB/s int8':>9}")


def print_row(r: dict, isas: list[str], f32_isas: list[str]) -> None:
    best = r[f"int8_{isas[0]}_us"]
    cols = "".join(f" {r[f'float32_{i}_us']:15.1f}" for i in f32_isas)
    cols += "".join(f" {r[f'int8_{i}_us']:17.1f}" for i in isas)
    int16 = f"{r['int16_us']:8.1f}" if "int16_us" in r else f"{'-':>8}"
    print(f"{r['type']:5} {r['N']:6d} {r['K']:5d} {r['rows']:4d}{cols} {int16}"
          f" {r['float32_us'] / best:8.2f}x {r['weight_bytes'] / r['float32_us'] / 1e3:8.2f}"
          f" {r['weight_bytes'] / best / 1e3:9.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--types", nargs="+", default=list(TYPES))
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--all-isas", action="store_true",
                   help="every instruction set this CPU has, float32 and int8 (default: the "
                        "best; float32 always also on plain C++, the path before AVX2 had one)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from airserve.srt.layers.quant import block_matvec

    if not block_matvec.kernels_available():
        raise SystemExit(f"the packed kernels did not build: {block_matvec.unavailable_reason()}")
    cpu = cpu_info()
    isas = block_matvec.int8_isas() if a.all_isas else block_matvec.int8_isas()[:1]
    f32_isas = block_matvec.float32_isas()
    if not a.all_isas:
        f32_isas = list(dict.fromkeys([f32_isas[0], "scalar"]))
    print(f"CPU: {cpu['model']}; features: {' '.join(cpu['features'])}; threads {a.threads}; "
          f"float32 instruction sets: {', '.join(block_matvec.float32_isas())}; "
          f"int8: {', '.join(block_matvec.int8_isas())}")
    print_header(isas, f32_isas)
    results = run(a.rows, a.types, a.repeats, isas, f32_isas)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu, "threads": a.threads, "int8_isas": block_matvec.int8_isas(),
                       "float32_isas": block_matvec.float32_isas(),
                       "note": "median of repeats; shared machine: figures are noisy",
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
