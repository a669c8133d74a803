"""Where a compiled decode step's time goes, and what an inductor option changes.

Builds the default model with the CPU graph runner (`--enable-torch-compile`) for the given
buckets and, with `--inductor cpp_wrapper=True` (options added to
`graph_runners.cpu.INDUCTOR_OPTIONS`), a second runner on the same model whose decode graphs
are compiled with them. Each prefills one 32-token prompt and runs greedy bs-1 decode steps
through `ModelRunner.forward` (graph replay), the two taking turns step by step (with
`--threads 1` timed in the thread's CPU time, which a busy machine does not inflate). Prints
each one's build and capture (compile) seconds, median step milliseconds, and a torch.profiler
breakdown of the step per op (self CPU milliseconds per step, grouped: the Q4_1 products (float32
by default, int8 with `--cpu-decode-activations int8`),
the lm_head, attention, other custom ops, aten ops; `rest` = step minus the ops the profiler
saw: inductor's own kernels and the generated wrapper's Python). JSON with `--json`. Timing
on a shared machine is noisy.

    python benchmark/runners/profile_step.py [--inductor cpp_wrapper=True] [--steps 100]
        [--profile-steps 20] [--threads 2] [--buckets 1] [--model-path F] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "throughput"))

GROUPS = (("airserve::q4_1_matmul", "q4_1 products (float32)"),
          ("airserve::block_matmul_int8", "q4_1 int8 products"),
          ("airserve::q8_0_matmul", "lm_head (q8_0, float32)"),
          ("attention", "attention"),
          ("airserve::", "other custom ops"),
          ("aten::", "aten ops"))


def group_of(name: str) -> str:
    for key, group in GROUPS:
        if key in name:
            return group
    return "other"


def build(a: argparse.Namespace, options: dict, runner_from=None):
    """A ModelRunner whose decode graphs are compiled with `options` added to the CPU graph
    runner's inductor options (sharing `runner_from`'s model when given), and its build
    seconds."""
    from airserve.srt.model_executor.graph_runners import cpu
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    extra = {"model_path": a.model_path} if a.model_path else {}
    args = ServerArgs(enable_torch_compile=True, cuda_graph_bs=tuple(a.buckets),
                      num_threads=a.threads, max_total_tokens=4096, **extra)
    saved = dict(cpu.INDUCTOR_OPTIONS)
    cpu.INDUCTOR_OPTIONS.update(options)
    t0 = time.perf_counter()
    try:
        if runner_from is None:
            runner = ModelRunner(args)
        else:
            runner = ModelRunner(args, model_config=runner_from.model_config,
                                 model=runner_from.model)
    finally:
        cpu.INDUCTOR_OPTIONS.clear()
        cpu.INDUCTOR_OPTIONS.update(saved)
    return runner, time.perf_counter() - t0


@torch.inference_mode()
def step_times(batches: dict, steps: int, cpu_time: bool) -> dict[str, float]:
    """Median milliseconds per decode step of each variant, the variants taking turns step by
    step (a busy machine's slow spells hit all alike). `cpu_time`: the calling thread's CPU
    time (with one thread, all of a step's work, whatever else the machine runs)."""
    for batch in batches.values():
        for _ in range(3):
            batch.step()
    times: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(steps):
        for name, batch in batches.items():
            t0 = time.thread_time()
            wall = batch.step()
            times[name].append((time.thread_time() - t0 if cpu_time else wall) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


@torch.inference_mode()
def profile(batch, profile_steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(profile_steps):
            batch.step()
        profiled_ms = (time.perf_counter() - t0) * 1e3 / profile_steps
    groups: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    ops = []
    for e in prof.key_averages():
        # Self times: an op's children are counted once, under their own name.
        ms = e.self_cpu_time_total / 1e3 / profile_steps
        ops.append((e.key, ms, e.count / profile_steps))
    for key, ms, count in ops:
        groups[group_of(key)] += ms
        calls[group_of(key)] += round(count)
    seen = sum(groups.values())
    return {"profiled_step_ms": profiled_ms, "groups_ms": dict(groups),
            "calls_per_step": dict(calls), "rest_ms": profiled_ms - seen,
            "top_ops": sorted(({"op": k, "ms": m, "calls": c} for k, m, c in ops),
                              key=lambda r: -r["ms"])[:15]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra inductor options of the decode graphs")
    p.add_argument("--buckets", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--profile-steps", type=int, default=20,
                   help="steps under torch.profiler (0: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-path", default=None,
                   help="another GGUF or HF directory (default: the default model)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from bench_decode_step import Batch
    from bench_w2 import key_values

    from airserve.srt.hardware import host_cpu

    variants = {"default": {}}
    if a.inductor:
        variants[" ".join(a.inductor)] = key_values(a.inductor, "--inductor")
    rows, batches, first = [], {}, None
    for name, options in variants.items():
        runner, build_s = build(a, options, first)
        first = first or runner
        rows.append({"variant": name, "inductor": options, "build_s": build_s,
                     "capture_s": sum(runner.graph_runner.capture_seconds.values())})
        batches[name] = Batch(runner, [list(range(100, 132))])
    medians = step_times(batches, a.steps, cpu_time=a.threads == 1)
    for row in rows:
        row["step_ms"] = medians[row["variant"]]
        row["step_clock"] = "thread CPU time" if a.threads == 1 else "wall"
        if a.profile_steps > 0:
            row.update(profile(batches[row["variant"]], a.profile_steps))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": host_cpu()[0], "threads": a.threads, "buckets": a.buckets,
                       "model": Path(a.model_path).name if a.model_path else "default",
                       "note": "shared machine: figures are noisy", "rows": rows}, f, indent=2)
    for row in rows:
        print(f"{row['variant']}: build {row['build_s']:.1f} s (capture {row['capture_s']:.1f} s);"
              f" step {row['step_ms']:.2f} ms median")
        if "groups_ms" not in row:
            continue
        print(f"  profiled step {row['profiled_step_ms']:.2f} ms")
        for group, ms in sorted(row["groups_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {group:32s} {ms:6.2f} ms  {row['calls_per_step'][group]:4d} calls")
        print(f"  {'rest (inductor kernels, wrapper)':32s} {row['rest_ms']:6.2f} ms")


if __name__ == "__main__":
    main()
