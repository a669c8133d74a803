"""bs-1 decode steps of the default model (eager) with two decode attention kernels taking turns
step by step in one process: the package's C++ operator and another implementation (by default
`csrc/decode_attention.cpp` as of git `main`, built alone; see bench_decode_attention.py for the
names). A busy machine's slow spells hit both alike. Prints median milliseconds per step.

    python benchmark/kernels/decode_step_attention.py [--baseline git:main] [--steps 100]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode_attention import resolve  # noqa: E402
from decode_step import interleaved_steps, write_row  # noqa: E402


def measure(runner, ops: dict, steps: int) -> dict:
    from airserve.srt.layers.attention import torch_native_backend as tnb

    current = {"op": None}
    # The backend looks the op up per call: route it to the implementation of this step.
    tnb.decode_attention_op = lambda q, k_cache, cpp_built: current["op"]
    return interleaved_steps(
        runner, {name: functools.partial(current.__setitem__, "op", op)
                 for name, op in ops.items()}, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="git:main")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    ops = {a.baseline: resolve(a.baseline), "cpp": resolve("cpp")}
    runner = ModelRunner(ServerArgs(num_threads=a.threads, max_total_tokens=4096))
    row = {"threads": a.threads, "steps": a.steps, **measure(runner, ops, a.steps)}
    print(f"bs 1 decode step, {a.threads} threads, cached {row['cached_tokens']}: "
          f"{a.baseline} {row[a.baseline + '_ms']:.2f} ms, cpp {row['cpp_ms']:.2f} ms")
    write_row(a.json, row)


if __name__ == "__main__":
    main()
