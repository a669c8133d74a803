"""One bs-1 decode step of the default model (eager), float32 against int8 activations in the
packed products, the two taking turns step by step in one process (so a busy machine's slow
spells hit both alike). Prints the median milliseconds per step of each and their ratio.

    python benchmark/kernels/decode_step.py [--steps 40] [--threads 2] [--json F]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

ACTIVATIONS = ("float32", "auto")


def set_activations(model: torch.nn.Module, activations: str) -> None:
    from airserve.srt.layers.linear import Linear

    for m in model.modules():
        if isinstance(m, Linear) and m.packed_max_rows:
            m.packed_activations = activations


@torch.inference_mode()
def interleaved_steps(runner, variants: dict[str, Callable[[], None]], steps: int,
                      prompt_len: int = 32) -> dict:
    """Prefill one prompt, then greedy bs-1 decode steps with each variant in turn (its
    callable switches the runner to it before its step): median milliseconds per step of each
    (`<name>_ms`) and the cached lengths at the start and the end."""
    from airserve.srt.forward_batch import ForwardMode

    slot = runner.req_to_token_pool.allocate()
    loc = runner.allocator.allocate(slot, 0, prompt_len)
    fb = runner.make_forward_batch(
        ForwardMode.EXTEND, input_ids=list(range(100, 100 + prompt_len)),
        positions=list(range(prompt_len)), req_pool_indices=[slot], seq_lens=[prompt_len],
        out_cache_loc=loc, extend_seq_lens=[prompt_len], extend_prefix_lens=[0],
        last_token_indices=[prompt_len - 1])
    token = int(runner.forward(fb).argmax(-1)[0])
    n = prompt_len
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in range(steps + 2):  # two warm-up steps each
        for name, switch in variants.items():
            switch()
            loc = runner.allocator.allocate(slot, n, n + 1)
            fb = runner.make_forward_batch(
                ForwardMode.DECODE, input_ids=[token], positions=[n], req_pool_indices=[slot],
                seq_lens=[n + 1], out_cache_loc=loc)
            t0 = time.perf_counter()
            token = int(runner.forward(fb).argmax(-1)[0])
            if step >= 2:
                times[name].append((time.perf_counter() - t0) * 1e3)
            n += 1
    runner.allocator.free(slot, n)
    runner.req_to_token_pool.free(slot)
    return {f"{name}_ms": statistics.median(t) for name, t in times.items()} | {
        "cached_tokens": [prompt_len, n]}


def measure(runner, steps: int) -> dict:
    return interleaved_steps(
        runner, {a: functools.partial(set_activations, runner.model, a) for a in ACTIVATIONS},
        steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(num_threads=a.threads, max_total_tokens=4096))
    row = {"threads": a.threads, "steps": a.steps, **measure(runner, a.steps)}
    row["speedup"] = row["float32_ms"] / row["auto_ms"]
    print(f"bs 1 decode step, {a.threads} threads: float32 {row['float32_ms']:.2f} ms, auto "
          f"(int8 for Q4_1) {row['auto_ms']:.2f} ms, {row['speedup']:.2f}x")
    write_row(a.json, row)


def write_row(path: str | None, row: dict) -> None:
    """The row as JSON at `path` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump({**row, "note": "median of interleaved steps; shared machine"}, f, indent=1)


if __name__ == "__main__":
    main()
