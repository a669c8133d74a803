"""What dynamo costs per decode step in the CPU graph runner, and what calling the compiled
graph directly saves.

Builds the default model with `CPUGraphRunner` for the given buckets, then times each bucket's
replay three ways, taking turns step by step: the direct call of the compiled graph (what
replay does), the compiled function through dynamo with guard evaluation skipped (replay
before), and through dynamo with full guards. With `--compare-static` it also builds a second
runner on the same model whose buckets are compiled one by one with static shapes
(`CPUGraphRunner.dynamic_batch = False`) and times its direct replay beside the shared-graph
one (`static_direct_ms`). Median milliseconds per step; JSON with `--json`. On a shared machine
compare columns of one run.

    python benchmark/runners/replay_overhead.py [--buckets 1 4] [--steps 50] [--threads 2]
        [--compare-static]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def build(buckets: list[int], threads: int, cache_dir: str | None, runner_from=None,
          dynamic_batch: bool = True):
    from airserve.srt.model_executor.graph_runners.cpu import CPUGraphRunner
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    args = ServerArgs(enable_torch_compile=True, cuda_graph_bs=tuple(buckets),
                      num_threads=threads, max_total_tokens=4096, compile_cache_dir=cache_dir)
    CPUGraphRunner.dynamic_batch = dynamic_batch
    try:
        if runner_from is None:
            return ModelRunner(args)
        return ModelRunner(args, model_config=runner_from.model_config, model=runner_from.model)
    finally:
        CPUGraphRunner.dynamic_batch = True


@torch.inference_mode()
def measure(runner, steps: int, static_runner=None) -> list[dict]:
    gr = runner.graph_runner
    sr = static_runner.graph_runner if static_runner is not None else None
    rows = []
    for bs in gr.buckets:
        static = gr.inputs.batches[bs]
        gr.attn_backend.init_forward_metadata_capture(static, bs)
        gr.replay_bucket(bs, static)  # the first replay decides direct or not

        def dynamo(skip: bool, bs=bs, static=static):
            with torch.compiler.set_stance(skip_guard_eval_unsafe=skip):
                return gr.compiled[bs](static)

        ways = {"direct_ms": lambda bs=bs, static=static: gr.replay_bucket(bs, static),
                "dynamo_skip_guards_ms": lambda: dynamo(True),
                "dynamo_full_guards_ms": lambda: dynamo(False)}
        if sr is not None:
            s_static = sr.inputs.batches[bs]
            sr.attn_backend.init_forward_metadata_capture(s_static, bs)
            sr.replay_bucket(bs, s_static)
            ways["static_direct_ms"] = lambda bs=bs, s=s_static: sr.replay_bucket(bs, s)
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(steps):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        row = {"bs": bs, "direct": bs in gr.direct, "symbolic": gr.graphs[bs].symbolic
               if bs in gr.graphs else None,
               **{k: statistics.median(v) for k, v in times.items()}}
        row["saved_ms"] = row["dynamo_skip_guards_ms"] - row["direct_ms"]
        rows.append(row)
        print(f"bs {bs:3d}: direct {row['direct_ms']:7.2f} ms, dynamo (guards skipped) "
              f"{row['dynamo_skip_guards_ms']:7.2f} ms, dynamo (full guards) "
              f"{row['dynamo_full_guards_ms']:7.2f} ms, saved {row['saved_ms']:.2f} ms"
              + (f", static-shape compile {row['static_direct_ms']:7.2f} ms" if sr else ""),
              flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 4])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile-cache-dir", default=None)
    p.add_argument("--compare-static", action="store_true",
                   help="also time per-bucket static-shape compiles of the same model")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from airserve.srt.hardware import host_cpu

    runner = build(a.buckets, a.threads, a.compile_cache_dir)
    static = (build(a.buckets, a.threads, None, runner_from=runner, dynamic_batch=False)
              if a.compare_static else None)
    rows = measure(runner, a.steps, static)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": host_cpu()[0], "threads": a.threads, "steps": a.steps,
                       "capture_seconds": runner.graph_runner.capture_seconds,
                       "graphs_compiled": runner.graph_runner.report()["graphs_compiled"],
                       "note": "median per step; shared machine: figures are noisy",
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
