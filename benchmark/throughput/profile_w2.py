"""Where W2's wall time goes in the offline Engine: per-step timing and an operator profile.

Runs W2 (N prompts of L random ids, M greedy new tokens, `ignore_eos`, all submitted at once)
step by step through `Scheduler.step()` and splits the wall time into:

  prefill steps   (forward, and the rest of the step: batch building, sampling, bookkeeping)
  decode steps    by batch size (the same split)
  idle            wall time outside any step (the loop itself)

Then, with --ops, profiles one prefill step and a few decode steps with torch.profiler and
lists the operators by self CPU time, matmuls by input shape, with the GFLOP/s each reached.

    python benchmark/throughput/profile_w2.py --mode eager --ops --json w2_profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_w2 import MODES, PATH_ARGS, key_values  # noqa: E402

MATMUL_OPS = ("aten::addmm", "aten::mm", "aten::linear", "mkldnn::_linear_pointwise",
              "airserve::onednn_linear", "airserve::fp16_weight_linear_cpp", "aten::bmm")


def build_engine(args: argparse.Namespace):
    import airserve

    kwargs = dict(MODES[args.mode], **PATH_ARGS[args.path])
    kwargs.update(num_threads=args.num_threads, max_running_requests=args.num_prompts)
    if kwargs.get("enable_torch_compile"):
        kwargs["cuda_graph_bs"] = tuple(args.graph_bs)
    kwargs.update(key_values(args.server_arg, "--server-arg"))
    return airserve.Engine(**kwargs)


def make_prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    # Each phase its own prompts: the prefix cache must not serve one phase from another.
    rng = random.Random(seed)
    return [[rng.randrange(100, 49052) for _ in range(args.input_len)]
            for _ in range(args.num_prompts)]


def add_requests(engine, prompts: list[list[int]], output_len: int) -> list:
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": output_len}
    reqs, _ = engine._make_reqs(None, params, prompts, False,
                                {"return_logprob": False, "logprob_start_len": None,
                                 "top_logprobs_num": None})
    for req in reqs:
        engine.scheduler.add_request(req)
    return reqs


class StepTimer:
    """Wraps the model runner's forward (this instance only) to time each forward and name its
    batch: ("prefill", tokens) or ("decode", batch size)."""

    def __init__(self, runner) -> None:
        self.runner, self.inner = runner, runner.forward
        self.last: tuple[str, int, float] | None = None
        runner.forward = self._forward

    def _forward(self, fb):
        t = time.perf_counter()
        out = self.inner(fb)
        kind = "decode" if fb.forward_mode.is_decode() else "prefill"
        size = fb.batch_size if kind == "decode" else int(fb.input_ids.numel())
        self.last = (kind, size, time.perf_counter() - t)
        return out

    def close(self) -> None:
        self.runner.forward = self.inner


def time_steps(engine, prompts, output_len: int) -> dict:
    timer = StepTimer(engine.model_runner)
    reqs = add_requests(engine, prompts, output_len)
    buckets: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    t0 = last_end = time.perf_counter()
    idle = 0.0
    while not all(r.finished for r in reqs):
        t = time.perf_counter()
        idle += t - last_end
        timer.last = None
        engine.scheduler.step()
        last_end = time.perf_counter()
        if timer.last is None:
            continue
        kind, size, fwd = timer.last
        key = "prefill" if kind == "prefill" else f"decode bs {_bs_range(size)}"
        b = buckets[key]
        b["steps"] += 1
        b["forward_s"] += fwd
        b["rest_s"] += last_end - t - fwd
        b["tokens" if kind == "prefill" else "rows"] += size
    wall = time.perf_counter() - t0
    timer.close()
    out_tokens = sum(len(r.output_ids) for r in reqs)
    return {"wall_s": wall, "output_tok_s": out_tokens / wall, "idle_s": idle,
            "buckets": {k: dict(v) for k, v in sorted(buckets.items())}}


def add_w2_arguments(p: argparse.ArgumentParser, rounds: int | None = None) -> None:
    """The W2 shape and thread count (and --rounds, --json) the A/B scripts share."""
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--json", default=None)


def run_record(timing: dict, **labels) -> dict:
    """One W2 run of an A/B as a row: its labels, wall, tok/s, prefill and decode forward."""
    b = timing["buckets"]
    decode = [v for k, v in b.items() if k.startswith("decode")]
    return {**labels, "wall_s": round(timing["wall_s"], 3),
            "output_tok_s": round(timing["output_tok_s"], 1),
            "prefill_forward_s": round(b["prefill"]["forward_s"], 3),
            "decode_forward_s": round(sum(d["forward_s"] for d in decode), 3),
            "decode_rest_s": round(sum(d["rest_s"] for d in decode), 3)}


def ab_rounds(engines: dict[str, tuple], rounds: int, output_len: int,
              prompt_seed: Callable[[int, int], int],
              around: Callable[[str], contextlib.AbstractContextManager] | None = None
              ) -> list[dict]:
    """The rounds of an A/B on offline Engines built in one process: `engines` maps each side's
    name to (its build_engine args, the Engine). Each round runs every side once, the order
    rotated by one side a round (two sides: alternating), so the machine's drift hits every
    side alike; the i-th side run in round r gets the prompts of seed `prompt_seed(r, i)`, and
    runs inside `around(name)` when given. Returns `run_record` rows labelled round and side."""
    names = list(engines)
    runs = []
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for i, name in enumerate(order):
            engine_args, engine = engines[name]
            prompts = make_prompts(engine_args, prompt_seed(r, i))
            with around(name) if around else contextlib.nullcontext():
                t = time_steps(engine, prompts, output_len)
            runs.append(run_record(t, round=r + 1, side=name))
            print(runs[-1], flush=True)
    return runs


def write_ab_json(path: str, cpu: str, args: argparse.Namespace, runs: list[dict],
                  summary: dict) -> None:
    """An A/B's record: the CPU, the arguments (each `--side` as a list), the runs, the
    medians."""
    Path(path).write_text(json.dumps({
        "cpu": cpu, "args": {**vars(args), "side": [list(s) for s in args.side]},
        "runs": runs, "median": summary}, indent=1))


def ab_medians(runs: list[dict], names: list[str], keys: tuple[str, ...]) -> dict[str, dict]:
    """Per side of an A/B (`run_record` rows labelled `side` and `round`): the median of each
    of `keys`, and `speedup_vs_first`, the median over rounds of the first side's wall time
    over this side's (the same requests, so also this side's tok/s over the first's)."""
    summary = {}
    for name in names:
        mine = [x for x in runs if x["side"] == name]
        med = {k: statistics.median(x[k] for x in mine) for k in keys}
        ratios = [a["wall_s"] / b["wall_s"] for a in runs if a["side"] == names[0]
                  for b in mine if b["round"] == a["round"]]
        med["speedup_vs_first"] = round(statistics.median(ratios), 3)
        summary[name] = med
    return summary


def _bs_range(bs: int) -> str:
    for lo, hi in ((1, 8), (9, 16), (17, 32), (33, 63)):
        if lo <= bs <= hi:
            return f"{lo}-{hi}"
    return str(bs)


def _flops(name: str, shapes: list) -> float:
    """Multiply-add FLOPs of one matmul call from its input shapes (0 if unknown)."""
    try:
        if name == "aten::addmm":
            (m, k), (_, n) = shapes[1], shapes[2]
        elif name == "aten::mm":
            (m, k), (_, n) = shapes[0], shapes[1]
        elif name in ("aten::linear", "mkldnn::_linear_pointwise"):
            m, k = shapes[0][0], shapes[0][-1]
            n = shapes[1][0]
        else:
            return 0.0
        return 2.0 * m * k * n
    except (IndexError, ValueError, TypeError):
        return 0.0


def profile_ops(engine, prompts, decode_steps: int) -> dict:
    """torch.profiler over the first prefill step and `decode_steps` decode steps at full
    batch; operators by self CPU time per phase, matmuls by shape."""
    from torch.profiler import ProfilerActivity, profile

    reqs = add_requests(engine, prompts, decode_steps + 2)
    result = {}
    timer = StepTimer(engine.model_runner)
    phases = [("prefill", 1)]
    # The remaining prefill steps run unprofiled; then decode steps at full batch.
    while True:
        name, steps = phases[0] if phases else ("decode", decode_steps)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                engine.scheduler.step()
            wall = time.perf_counter() - t
        result[name] = summarize(prof, wall, steps)
        if not phases:
            break
        phases.clear()
        while engine.scheduler.waiting or engine.scheduler.chunked_req:
            engine.scheduler.step()
        engine.scheduler.step()  # first decode step (the graph runner warms up)
    timer.close()
    while not all(r.finished for r in reqs):
        engine.scheduler.step()
    return result


def summarize(prof, wall: float, steps: int, top: int = 25) -> dict:
    ops: dict[str, float] = defaultdict(float)
    mm: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for ev in prof.key_averages(group_by_input_shape=True):
        ops[ev.key] += ev.self_cpu_time_total / 1e6
        if ev.key in MATMUL_OPS:
            shapes = [list(s) for s in ev.input_shapes]
            key = f"{ev.key} {shapes[:3]}"
            entry = mm[key]
            entry[0] += ev.cpu_time_total / 1e6
            entry[1] += _flops(ev.key, shapes) * ev.count
            entry[2] += ev.count
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
    matmuls = sorted(mm.items(), key=lambda kv: -kv[1][0])[:top]
    return {"wall_s": wall, "steps": steps,
            "ops_self_s": {k: round(v, 4) for k, v in ranked},
            "matmuls": {k: {"s": round(s, 4), "calls": n,
                            "gflops": round(f / s / 1e9, 1) if s and f else None}
                        for k, (s, f, n) in matmuls}}


def print_report(timing: dict, ops: dict | None) -> None:
    print(f"wall {timing['wall_s']:.2f} s, {timing['output_tok_s']:.1f} output tok/s, "
          f"between steps {timing['idle_s']:.2f} s")
    print("| steps | count | forward (s) | rest of step (s) | tokens/rows |")
    print("|---|---|---|---|---|")
    for key, b in timing["buckets"].items():
        size = b.get("tokens", b.get("rows", 0))
        print(f"| {key} | {b['steps']:.0f} | {b['forward_s']:.2f} | {b['rest_s']:.2f} | "
              f"{size:.0f} |")
    for phase, rep in (ops or {}).items():
        print(f"\n{phase}: {rep['steps']} step(s), {rep['wall_s']:.2f} s under the profiler")
        for name, s in rep["ops_self_s"].items():
            print(f"  {s:8.3f} s  {name}")
        print("  matmuls (total time incl. children, GFLOP/s):")
        for name, m in rep["matmuls"].items():
            print(f"  {m['s']:8.3f} s  {m['calls']:5d} calls  {m['gflops']} GFLOP/s  {name}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=sorted(MODES), default="eager")
    p.add_argument("--path", choices=sorted(PATH_ARGS), default="auto")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--graph-bs", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra Engine argument NAME=VALUE (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", action="store_true", help="also profile operators")
    p.add_argument("--decode-steps", type=int, default=5)
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    engine = build_engine(args)
    warm = make_prompts(args, args.seed + 2)[0][:32]
    engine.generate(input_ids=warm, sampling_params={"temperature": 0.0, "max_new_tokens": 8})
    timing = {"wall_s": 0.0, "output_tok_s": 0.0, "idle_s": 0.0, "buckets": {}}
    if not args.no_timing:
        timing = time_steps(engine, make_prompts(args, args.seed), args.output_len)
    ops = None
    if args.ops:
        ops = profile_ops(engine, make_prompts(args, args.seed + 1), args.decode_steps)
    print_report(timing, ops)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "timing": timing,
                                               "ops": ops}, indent=1))
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
