"""Where a compiled decode step's time goes, and what an inductor option changes.

Builds the default model with the CPU graph runner (`--enable-torch-compile`) for the given
buckets, with extra inductor options for its decode graphs (`--inductor cpp_wrapper=True`;
added to `graph_runners.cpu.INDUCTOR_OPTIONS`), prefills one 32-token prompt and runs greedy
bs-1 decode steps through `ModelRunner.forward` (graph replay). Prints the capture (compile)
seconds, the median step milliseconds, and a torch.profiler breakdown of the step per op
(self CPU milliseconds per step, grouped: the Q4_1 int8 products, the lm_head, attention, other
custom ops, aten ops; `rest` = step minus the ops the profiler saw: inductor's own kernels and
the generated wrapper's Python). JSON with `--json`. Timing on a shared machine is noisy.

    python benchmark/runners/profile_step.py [--inductor cpp_wrapper=True] [--steps 100]
        [--profile-steps 20] [--threads 2] [--buckets 1] [--json F]
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

GROUPS = (("airserve::block_matmul_int8", "q4_1 int8 products"),
          ("airserve::q8_0_matmul", "lm_head (q8_0, float32)"),
          ("attention", "attention"),
          ("airserve::", "other custom ops"),
          ("aten::", "aten ops"))


def group_of(name: str) -> str:
    for key, group in GROUPS:
        if key in name:
            return group
    return "other"


def parse_options(items: list[str]) -> dict:
    """KEY=VALUE pairs; a value is read as a Python literal when it is one."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--inductor takes KEY=VALUE, got {item!r}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


def build(a: argparse.Namespace):
    from airserve.srt.model_executor.graph_runners import cpu
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    cpu.INDUCTOR_OPTIONS.update(parse_options(a.inductor))
    args = ServerArgs(enable_torch_compile=True, cuda_graph_bs=tuple(a.buckets),
                      num_threads=a.threads, max_total_tokens=4096)
    t0 = time.perf_counter()
    runner = ModelRunner(args)
    return runner, time.perf_counter() - t0


@torch.inference_mode()
def profile(runner, steps: int, profile_steps: int) -> dict:
    from bench_decode_step import Batch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batch = Batch(runner, [list(range(100, 132))])
    for _ in range(3):
        batch.step()
    step_ms = statistics.median(batch.step() * 1e3 for _ in range(steps))
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(profile_steps):
            batch.step()
        profiled_ms = (time.perf_counter() - t0) * 1e3 / profile_steps
    batch.free()
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
    return {"step_ms": step_ms, "profiled_step_ms": profiled_ms,
            "groups_ms": dict(groups), "calls_per_step": dict(calls),
            "rest_ms": profiled_ms - seen,
            "top_ops": sorted(({"op": k, "ms": m, "calls": c} for k, m, c in ops),
                              key=lambda r: -r["ms"])[:15]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra inductor options of the decode graphs")
    p.add_argument("--buckets", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from airserve.srt.hardware import host_cpu

    runner, build_s = build(a)
    gr = runner.graph_runner
    row = {"inductor": parse_options(a.inductor), "build_s": build_s,
           "capture_s": sum(gr.capture_seconds.values()),
           **profile(runner, a.steps, a.profile_steps)}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": host_cpu()[0], "threads": a.threads, "buckets": a.buckets,
                       "note": "shared machine: figures are noisy", **row}, f, indent=2)
    print(f"inductor options {row['inductor'] or '(default)'}: build {build_s:.1f} s "
          f"(capture {row['capture_s']:.1f} s); step {row['step_ms']:.2f} ms median "
          f"({row['profiled_step_ms']:.2f} ms profiled)")
    for group, ms in sorted(row["groups_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {group:28s} {ms:6.2f} ms  {row['calls_per_step'][group]:4d} calls")
    print(f"  {'rest (inductor kernels, wrapper)':28s} {row['rest_ms']:6.2f} ms")


if __name__ == "__main__":
    main()
