"""OpenVINO decode against eager, the CPU inductor runner and transformers, on the default model.

All configurations live in one process on the same weights (the f16 one on a float16 copy) and
take turns: for each batch size, every round runs one batch of each configuration in turn
(`airserve.bench_one_batch.run_batch`: prefill, then greedy decode steps, each timed), so load
from other processes lands on all of them alike. Medians over all timed steps of all rounds.

    python benchmark/openvino/bench_openvino.py --output openvino_bench.json

Table 1: decode step per batch size: eager, inductor runner, OpenVINO (packed GGUF weights, f32;
with int8 activations; float32 weights; bf16 hint; f16 with --dtype float16), transformers eager
(batch 1); compile seconds per bucket.
Table 2: OpenVINO (packed, f32) at batch 1 with a small and a large KV pool (--max-total-tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from airserve.bench_one_batch import run_batch, time_transformers, transformers_model
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.server_args import ServerArgs

OPENVINO = {"enable_torch_compile": True, "torch_compile_backend": "openvino"}
CONFIGS: dict[str, dict] = {
    "eager": {},
    "inductor": {"enable_torch_compile": True},
    "openvino": OPENVINO,  # packed GGUF weights (u4/i8), f32 activations: the default
    "openvino_dq32": dict(OPENVINO, openvino_dynamic_quant_group_size=32),
    "openvino_float": dict(OPENVINO, openvino_weights="float"),
    "openvino_bf16": dict(OPENVINO, openvino_precision="bf16"),
    "openvino_f16": dict(OPENVINO, openvino_precision="f16", dtype="float16"),
}
BASE = "openvino"  # the configuration the others are compared with


def build(name: str, base: ServerArgs, models: dict) -> tuple[ModelRunner, float]:
    """A runner for configuration `name`, sharing weights with earlier ones loaded the same way
    (dtype, and which GGUF blocks the loader keeps for whom)."""
    args = base.replace(**CONFIGS[name])
    start = time.perf_counter()
    key = (args.dtype, args.resolved_packed_decode_max_bs, args.openvino_packed_weights)
    shared = models.get(key)
    runner = (ModelRunner(args, model_config=shared[0], model=shared[1]) if shared
              else ModelRunner(args))
    models.setdefault(key, (runner.model_config, runner.model))
    print(f"{name}: ready in {time.perf_counter() - start:.0f} s", flush=True)
    return runner, time.perf_counter() - start


def step_times(runner, prompts, output_len: int) -> list[float]:
    return run_batch(runner, prompts, output_len).decode_latencies


def table_row(steps: list[float], compile_s=None, load=None) -> dict:
    return {"median_ms": 1e3 * statistics.median(steps), "best_ms": 1e3 * min(steps),
            "steps": len(steps), "compile_s": compile_s, "load": load}


def bench_batch_sizes(args, runners: dict, hf) -> dict:
    g = torch.Generator().manual_seed(0)
    results: dict[str, dict] = {name: {} for name in list(runners) + ["transformers"]}
    for bs in args.batch_sizes:
        vocab = next(iter(runners.values())).model_config.vocab_size
        prompts = torch.randint(0, vocab, (bs, args.input_len), generator=g).tolist()
        steps = {name: [] for name in results}
        loads = []
        for runner in runners.values():
            run_batch(runner, prompts, 4)  # warm-up
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name, runner in runners.items():
                steps[name] += step_times(runner, prompts, args.output_len)
            if hf is not None and bs == 1:
                lat = time_transformers(hf, prompts, args.output_len)[0]
                steps["transformers"] += lat if isinstance(lat, list) else [lat]
        for name, runner in runners.items():
            report = runner.graph_runner.report() if runner.graph_runner else {}
            assert not runner.fallback_counts, runner.fallback_counts
            results[name][bs] = table_row(steps[name],
                                          report.get("capture_seconds", {}).get(bs),
                                          statistics.median(loads))
        if steps["transformers"]:
            results["transformers"][bs] = table_row(steps["transformers"])
        print(f"bs {bs}: " + ", ".join(f"{n} {r[bs]['median_ms']:.1f} ms"
                                      for n, r in results.items() if bs in r), flush=True)
    return results


def bench_pools(args, base: ServerArgs, models: dict) -> list[dict]:
    runners = {}
    for size in args.pool_sizes:
        pool_args = base.replace(max_total_tokens=size, cuda_graph_bs=(1,),
                                 max_running_requests=1)
        runners[size], _ = build(BASE, pool_args, models)
    prompts = [[1] * args.input_len]
    steps = {size: [] for size in runners}
    for _ in range(args.rounds):
        for size, runner in runners.items():
            steps[size] += step_times(runner, prompts, args.output_len)
    return [dict(table_row(steps[size]), max_total_tokens=size,
                 pool_mib=runner.kv_pool.memory_bytes() / 2**20)
            for size, runner in runners.items()]


def print_tables(results: dict, pools: list[dict], batch_sizes: list[int]) -> None:
    names = [n for n in results if results[n]]
    print("\ndecode step ms, median (best); [compile s of that bucket]")
    print("| bs | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for bs in batch_sizes:
        cells = []
        for n in names:
            r = results[n].get(bs)
            extra = f" [{r['compile_s']:.0f}]" if r and r.get("compile_s") else ""
            cells.append(f"{r['median_ms']:.1f} ({r['best_ms']:.1f}){extra}" if r else "-")
        print(f"| {bs} | " + " | ".join(cells) + " |")
    ov = results.get(BASE, {})
    for other in names:
        if other == BASE:
            continue
        ratios = [f"bs {bs} {results[other][bs]['median_ms'] / ov[bs]['median_ms']:.2f}x"
                  for bs in batch_sizes if bs in results[other] and bs in ov]
        print(f"{BASE} speed-up over {other}: {', '.join(ratios)}")
    if pools:
        print(f"\n| {BASE}, bs 1 | KV pool MiB | decode ms, median (best) |")
        print("|---|---|---|")
        for p in pools:
            print(f"| --max-total-tokens {p['max_total_tokens']} | {p['pool_mib']:.0f} | "
                  f"{p['median_ms']:.1f} ({p['best_ms']:.1f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--pool-sizes", type=int, nargs="*", default=[4096, 65536])
    parser.add_argument("--output", default="openvino_bench.json")
    args = parser.parse_args()

    bss = args.batch_sizes
    base = ServerArgs(num_threads=args.threads, max_running_requests=max(bss),
                      cuda_graph_bs=tuple(bss),
                      max_total_tokens=max(bss) * (args.input_len + args.output_len) + 256)
    models: dict = {}
    runners = {name: build(name, base, models)[0] for name in args.configs}
    hf = None if args.no_transformers else transformers_model(runners[args.configs[0]])
    results = bench_batch_sizes(args, runners, hf)
    pools = bench_pools(args, base, models) if args.pool_sizes else []
    print_tables(results, pools, bss)
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "results": results, "pools": pools,
                   "reports": {n: r.graph_runner.report() for n, r in runners.items()
                               if r.graph_runner}}, f, indent=1, default=str)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
