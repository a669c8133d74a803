"""Per-step overhead between the model runner's decode step and what users see, in one run.

For each batch size (default 1 and 64), greedy with `ignore_eos`, distinct seeded 32-token
prompts:

- `raw`: ModelRunner.forward on a decode ForwardBatch built by make_forward_batch, plus argmax
  (the step alone; `build` is make_forward_batch's share, timed apart);
- `engine`: the offline Engine's per-token time, (t(N tokens) - t(1 token)) / (N - 1), and
  where one decode step of `Scheduler.step` goes (perf_counter spans: schedule = next_batch
  with its batch build, forward, sample, rest of process = stop checks / detokenization /
  bookkeeping; `other` = step total minus those);
- `served`: `launch_server` with the same flags, every request streamed from /generate at
  once; the median gap between a stream's consecutive chunks (inter-token latency, one chunk
  per step).

The offline parts run in this process, the server after them (never both at once). Prints a
table and writes JSON, the CPU named. Timing on a shared machine is noisy: run it quiet.

    python benchmark/serving/step_overhead.py [--mode eager|compile|openvino] [--batch-sizes 1 64]
        [--tokens 64 16] [--no-served] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runners"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "throughput"))

PROMPT_LEN = 32
SPANS = ("schedule", "forward", "sample", "process_rest", "other")


def server_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {"num_threads": args.threads, "max_running_requests": max(args.batch_sizes),
              "cpu_decode_activations": args.activations}
    if args.mode in ("compile", "openvino"):
        kwargs.update(enable_torch_compile=True, cuda_graph_bs=tuple(args.graph_bs))
        if args.mode == "openvino":
            kwargs["torch_compile_backend"] = "openvino"
        if args.compile_cache_dir:
            kwargs["compile_cache_dir"] = args.compile_cache_dir
    return kwargs


def prompts(bs: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed + bs)
    return [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(bs)]


# ---- the raw step ----------------------------------------------------------------------------

@torch.inference_mode()
def raw_step(runner, bs: int, steps: int) -> dict:
    """Median ms of make_forward_batch and of forward + argmax for `bs` rows decoding."""
    from bench_decode_step import Batch

    batch = Batch(runner, prompts(bs))
    build, step = [], []
    for i in range(steps + 2):  # two warm-up steps
        build_s, _, step_s = batch.timed_step()
        if i >= 2:
            build.append(build_s)
            step.append(step_s)
    batch.free()
    return {"build_ms": 1e3 * statistics.median(build), "step_ms": 1e3 * statistics.median(step)}


# ---- the offline Engine, with spans ----------------------------------------------------------

class Spans:
    """perf_counter spans of Scheduler.step's parts, per step, patched onto one engine."""

    def __init__(self, engine) -> None:
        from airserve.srt.managers import isolation

        self.steps: list[dict] = []
        self.current: dict = defaultdict(float)
        sched = engine.scheduler
        self._timed(sched, "next_batch", "schedule")
        self._timed(sched, "process", "process")
        self._timed(isolation, "forward_isolated", "forward")
        self._timed(isolation, "sample_isolated", "sample")
        step = sched.step

        def timed_step():
            self.current = defaultdict(float)
            t0 = time.perf_counter()
            out = step()
            self.current["total"] = time.perf_counter() - t0
            self.steps.append(self.current)
            return out
        sched.step = timed_step

    def _timed(self, owner, name: str, span: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.current[span] += time.perf_counter() - t0
        setattr(owner, name, wrapper)

    def summary(self, first: int) -> dict:
        """Median ms of each span over the steps from `first` on that ran a forward."""
        steps = [s for s in self.steps[first:] if s.get("forward")]
        out = {}
        for key in ("total", "schedule", "forward", "sample", "process"):
            out[key] = 1e3 * statistics.median(s.get(key, 0.0) for s in steps)
        out["process_rest"] = 1e3 * statistics.median(
            s.get("process", 0.0) - s.get("sample", 0.0) for s in steps)
        out["other"] = 1e3 * statistics.median(
            s["total"] - s.get("schedule", 0) - s.get("forward", 0) - s.get("process", 0)
            for s in steps)
        return out


def run_engine(engine, spans: Spans, bs: int, tokens: int) -> dict:
    greedy = {"temperature": 0.0, "ignore_eos": True}
    batch = prompts(bs)
    engine.generate(input_ids=batch, sampling_params=dict(greedy, max_new_tokens=2))  # warm
    engine.scheduler.kv.flush()  # every run prefills the same way
    t0 = time.perf_counter()
    engine.generate(input_ids=batch, sampling_params=dict(greedy, max_new_tokens=1))
    first = time.perf_counter() - t0
    engine.scheduler.kv.flush()
    mark = len(spans.steps)
    t0 = time.perf_counter()
    engine.generate(input_ids=batch, sampling_params=dict(greedy, max_new_tokens=tokens))
    full = time.perf_counter() - t0
    engine.scheduler.kv.flush()
    # The decode steps: skip the prefill step(s) and the first decode step.
    decode = spans.summary(mark + 2)
    return {"per_token_ms": 1e3 * (full - first) / (tokens - 1), "spans_ms": decode}


def offline(args: argparse.Namespace) -> dict:
    import airserve

    engine = airserve.Engine(**server_kwargs(args))
    spans = Spans(engine)
    out = {}
    try:
        for bs, tokens in zip(args.batch_sizes, args.tokens):
            steps = args.raw_steps if bs == 1 else max(5, args.raw_steps // 4)
            raw = raw_step(engine.model_runner, bs, steps)
            out[bs] = {"raw": raw, "engine": run_engine(engine, spans, bs, tokens)}
            info = engine.get_server_info()
            out[bs]["eager_fallbacks"] = info.get("eager_fallbacks")
    finally:
        engine.shutdown()
    return out


# ---- served -----------------------------------------------------------------------------------

async def stream_all(url: str, bs: int, tokens: int) -> dict:
    """Stream `bs` requests at once; per stream the arrival time of each chunk."""
    import aiohttp

    greedy = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": tokens}

    async def one(session, ids: list[int]) -> list[float]:
        times = []
        body = {"input_ids": ids, "sampling_params": greedy, "stream": True}
        async with session.post(url + "/generate", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
            async for line in r.content:
                if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                    times.append(time.perf_counter())
        return times

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        await asyncio.gather(*(one(s, ids) for ids in prompts(bs)))  # warm-up, same prompts
        async with s.post(url + "/flush_cache") as r:
            await r.read()
        streams = await asyncio.gather(*(one(s, ids) for ids in prompts(bs)))
    gaps = [b - a for t in streams for a, b in zip(t[2:], t[3:])]  # from the 2nd decode on
    chunks = min(len(t) for t in streams)
    return {"itl_ms": 1e3 * statistics.median(gaps), "chunks_min": chunks}


def served(args: argparse.Namespace, log_dir: Path) -> dict:
    from bench_w2 import _flags, _free_port
    from compare_runners import Server

    out = {}
    with Server(_flags(server_kwargs(args)), _free_port(), log_dir / "server.log") as server:
        server.wait_ready(args.startup_timeout)
        for bs, tokens in zip(args.batch_sizes, args.tokens):
            out[bs] = asyncio.run(stream_all(server.url, bs, tokens))
    return out


# ---- driver -----------------------------------------------------------------------------------

def print_table(rows: dict, cpu: str, mode: str) -> None:
    print(f"\nstep overhead, {cpu}, {mode}; ms (median)")
    print(f"{'bs':>3} {'raw step':>9} {'build':>6} {'engine/tok':>10} {'served ITL':>10} "
          f"{'engine-raw':>10} {'served-raw':>10}  engine step spans")
    for bs, row in rows.items():
        raw = row["raw"]["step_ms"]
        eng = row["engine"]["per_token_ms"]
        srv = row.get("served", {}).get("itl_ms", float("nan"))
        spans = row["engine"]["spans_ms"]
        parts = " ".join(f"{k} {spans[k]:.2f}" for k in SPANS)
        print(f"{bs:>3} {raw:>9.2f} {row['raw']['build_ms']:>6.2f} {eng:>10.2f} {srv:>10.2f} "
              f"{eng - raw:>10.2f} {srv - raw:>10.2f}  {parts}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("eager", "compile", "openvino"), default="eager")
    p.add_argument("--graph-bs", type=int, nargs="+", default=[1],
                   help="graph runner buckets with --mode compile (others run eager)")
    p.add_argument("--compile-cache-dir", default="~/.cache/airserve/step_overhead_compile")
    p.add_argument("--activations", default="auto", help="--cpu-decode-activations")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 8],
                   help="new tokens per request, one per batch size")
    p.add_argument("--raw-steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-served", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--log-dir", default=None, help="for the server's log (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if len(args.tokens) != len(args.batch_sizes):
        p.error("--tokens needs one value per --batch-sizes entry")
    if min(args.tokens) < 4:
        p.error("--tokens: at least 4 per request (warm-up steps are skipped)")
    from airserve.srt.hardware import host_cpu

    torch.set_num_threads(args.threads)
    rows = offline(args)
    if not args.no_served:
        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="step_overhead_"))
        for bs, row in served(args, log_dir).items():
            rows[bs]["served"] = row
    cpu = host_cpu()[0]
    print_table(rows, cpu, args.mode)
    if args.json:
        result = {"cpu": cpu, "mode": args.mode, "activations": args.activations,
                  "threads": args.threads, "prompt_len": PROMPT_LEN,
                  "tokens": dict(zip(args.batch_sizes, args.tokens)),
                  "rows": {str(k): v for k, v in rows.items()}}
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
