"""bs-1 decode steps of the default model (eager) with two decode attention kernels taking turns
step by step in one process: the package's C++ operator and another implementation (by default
`csrc/decode_attention.cpp` as of git `main`, built alone; see bench_decode_attention.py for the
names). A busy machine's slow spells hit both alike. Prints median milliseconds per step.

    python benchmark/kernels/decode_step_attention.py [--baseline git:main] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode_attention import resolve  # noqa: E402


@torch.inference_mode()
def measure(runner, ops: dict, steps: int, prompt_len: int = 32) -> dict[str, float]:
    from airserve.srt.forward_batch import ForwardMode
    from airserve.srt.layers.attention import torch_native_backend as tnb

    current = {"op": None}
    # The backend looks the op up per call: route it to the implementation of this step.
    tnb.decode_attention_op = lambda q, k_cache, cpp_built: current["op"]
    slot = runner.req_to_token_pool.allocate()
    loc = runner.allocator.allocate(slot, 0, prompt_len)
    fb = runner.make_forward_batch(
        ForwardMode.EXTEND, input_ids=list(range(100, 100 + prompt_len)),
        positions=list(range(prompt_len)), req_pool_indices=[slot], seq_lens=[prompt_len],
        out_cache_loc=loc, extend_seq_lens=[prompt_len], extend_prefix_lens=[0],
        last_token_indices=[prompt_len - 1])
    token = int(runner.forward(fb).argmax(-1)[0])
    n = prompt_len
    times: dict[str, list[float]] = {name: [] for name in ops}
    for step in range(steps + 2):  # two warm-up steps each
        for name, op in ops.items():
            current["op"] = op
            loc = runner.allocator.allocate(slot, n, n + 1)
            fb = runner.make_forward_batch(
                ForwardMode.DECODE, input_ids=[token], positions=[n], req_pool_indices=[slot],
                seq_lens=[n + 1], out_cache_loc=loc)
            t0 = time.perf_counter()
            token = int(runner.forward(fb).argmax(-1)[0])
            if step >= 2:
                times[name].append((time.perf_counter() - t0) * 1e3)
            n += 1
    return {f"{name}_ms": statistics.median(t) for name, t in times.items()} | {
        "cached_tokens": [prompt_len, n]}


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
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**row, "note": "median of interleaved steps; shared machine"}, f, indent=1)


if __name__ == "__main__":
    main()
