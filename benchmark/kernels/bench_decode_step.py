"""The W2 decode step in situ, per float32 matmul implementation (--cpu-float32-matmul).

64 requests x 128 random prompt tokens on the offline Engine (default model, 2 threads),
greedy, ignore_eos, no prefix cache (each run prefills again): once with max_new_tokens 1
(prefill only) and once with 1 + STEPS; the difference over STEPS is the decode step at batch
64 (all requests decode together once the prefill is done). Implementations alternate per
repeat, so a busy machine slows all alike.

    python benchmark/kernels/bench_decode_step.py [--impls onednn sgemm] [--repeats 2]
        [--chunk 512 1024 2048]    # also each --chunked-prefill-size

On a busy machine the difference of two long runs drowns in noise; `--direct` times single
decode steps at batch 64 on a ModelRunner per implementation instead (requests prefilled once,
steps interleaved between implementations, median per step):

    python benchmark/kernels/bench_decode_step.py --direct [--prompt-len 32] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from airserve import Engine
from airserve.srt.forward_batch import ForwardMode
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.server_args import ServerArgs


def run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - t0
    assert all(len(o["output_ids"]) == new_tokens for o in outs)
    return elapsed


class Batch:
    """Requests prefilled on a runner, then stepped one greedy decode token at a time."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        self.slots = [runner.req_to_token_pool.allocate() for _ in prompts]
        self.lens = [len(p) for p in prompts]
        locs = [runner.allocator.allocate(s, 0, n) for s, n in zip(self.slots, self.lens)]
        ends = torch.tensor(self.lens).cumsum(0) - 1
        fb = runner.make_forward_batch(
            ForwardMode.EXTEND, input_ids=[t for p in prompts for t in p],
            positions=[i for p in prompts for i in range(len(p))],
            req_pool_indices=self.slots, seq_lens=self.lens, out_cache_loc=torch.cat(locs),
            extend_seq_lens=self.lens, extend_prefix_lens=[0] * len(prompts),
            last_token_indices=ends.tolist())
        self.tokens = runner.forward(fb).argmax(-1).tolist()

    def step(self) -> float:
        """Seconds of the forward pass of one decode step."""
        return self.timed_step()[1]

    def timed_step(self) -> tuple[float, float, float]:
        """One decode step: seconds of building its ForwardBatch (KV slots included), of the
        forward pass, and of the forward pass plus the greedy pick."""
        t0 = time.perf_counter()
        locs = [self.runner.allocator.allocate(s, n, n + 1)
                for s, n in zip(self.slots, self.lens)]
        fb = self.runner.make_forward_batch(
            ForwardMode.DECODE, input_ids=self.tokens, positions=self.lens,
            req_pool_indices=self.slots, seq_lens=[n + 1 for n in self.lens],
            out_cache_loc=torch.cat(locs))
        t1 = time.perf_counter()
        logits = self.runner.forward(fb)
        t2 = time.perf_counter()
        self.lens = [n + 1 for n in self.lens]
        self.tokens = logits.argmax(-1).tolist()
        return t1 - t0, t2 - t1, time.perf_counter() - t1

    def free(self) -> None:
        """Give the requests' KV pages and slots back to the runner."""
        for slot, n in zip(self.slots, self.lens):
            self.runner.allocator.free(slot, n)
            self.runner.req_to_token_pool.free(slot)


def direct(a: argparse.Namespace, prompts: list[list[int]]) -> None:
    batches = {}
    for impl in a.impls:
        args = ServerArgs(num_threads=a.threads, max_running_requests=a.requests,
                          max_total_tokens=a.requests * (a.prompt_len + a.steps + 8),
                          cpu_float32_matmul=impl)
        t0 = time.perf_counter()
        batches[impl] = Batch(ModelRunner(args), prompts)
        print(f"{impl}: loaded and prefilled in {time.perf_counter() - t0:.1f} s", flush=True)
    times: dict = {impl: [] for impl in a.impls}
    for _ in range(a.steps):
        for impl, batch in batches.items():
            times[impl].append(batch.step())
    tokens = {impl: b.tokens for impl, b in batches.items()}
    print(f"decode step at batch {a.requests} ({a.prompt_len}-token prompts, {a.threads} "
          f"threads), median of {a.steps} interleaved steps; greedy tokens equal across "
          f"implementations: {len({str(t) for t in tokens.values()}) == 1}")
    for impl, ts in times.items():
        print(f"{impl:>7}: {1000 * statistics.median(ts):6.1f} ms "
              f"(min {1000 * min(ts):.1f}, max {1000 * max(ts):.1f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impls", nargs="+", default=["onednn", "sgemm"])
    p.add_argument("--chunk", type=int, nargs="+", default=[512])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--direct", action="store_true",
                   help="time single decode steps on a ModelRunner (see above)")
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.requests)]
    if a.direct:
        direct(a, prompts)
        return
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
