"""The W2 decode step in situ, per float32 matmul implementation (--cpu-float32-matmul).

64 requests x 128 random prompt tokens on the offline Engine (default model, 2 threads),
greedy, ignore_eos, no prefix cache (each run prefills again): once with max_new_tokens 1
(prefill only) and once with 1 + STEPS; the difference over STEPS is the decode step at batch 64 (all requests decode together once the
prefill is done). Implementations alternate per repeat, so a busy machine slows all alike.

    python benchmark/kernels/bench_decode_step.py [--impls onednn sgemm] [--repeats 2]
        [--chunk 512 1024 2048]    # also each --chunked-prefill-size
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from airserve import Engine


def run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - t0
    assert all(len(o["output_ids"]) == new_tokens for o in outs)
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impls", nargs="+", default=["onednn", "sgemm"])
    p.add_argument("--chunk", type=int, nargs="+", default=[512])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.requests)]
    configs = [(impl, chunk) for impl in a.impls for chunk in a.chunk]
    tokens = a.requests * (a.prompt_len + a.steps + 8)  # a small KV pool: two engines at once
    engines = {c: Engine(num_threads=a.threads, max_running_requests=a.requests,
                         max_total_tokens=tokens, disable_radix_cache=True,
                         cpu_float32_matmul=c[0], chunked_prefill_size=c[1]) for c in configs}
    prefill: dict = {c: [] for c in configs}
    step: dict = {c: [] for c in configs}
    for c in configs:  # warm-up
        run(engines[c], prompts[:4], 2)
    for _ in range(a.repeats):
        for c in configs:
            t1 = run(engines[c], prompts, 1)
            tn = run(engines[c], prompts, 1 + a.steps)
            prefill[c].append(t1)
            step[c].append((tn - t1) / a.steps)
    print(f"{a.requests} x {a.prompt_len} prompt tokens, {a.threads} threads; "
          f"median of {a.repeats} (all repeats)")
    for c in configs:
        print(f"{c[0]:>7} chunk {c[1]:5d}: prefill {statistics.median(prefill[c]):6.2f} s "
              f"{[round(t, 2) for t in prefill[c]]}; decode step at batch {a.requests} "
              f"{1000 * statistics.median(step[c]):6.1f} ms "
              f"{[round(1000 * t, 1) for t in step[c]]}")
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
