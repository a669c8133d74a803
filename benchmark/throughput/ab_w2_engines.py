"""W2 on two or more offline Engines built in one process, runs alternating: for settings that
need an engine of their own (the KV cache's element type, the page size), so that the machine's
drift between minutes hits every side alike, which separate processes run one after another
(bench_w2.py) do not.

Each `--side NAME=key=value,key=value` is an engine in compile mode (the CPU graph runner) with
those ServerArgs; every round runs W2 once on each, in an order that rotates from round to
round, with fresh prompts each run (no prefix-cache hits). Prints each side's median wall and
tok/s with its ratio to the first side, and writes JSON.

    python benchmark/throughput/ab_w2_engines.py --side f16=kv_cache_dtype=float16 \
        --side int8=kv_cache_dtype=int8 --rounds 4 --json ab_kv.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import profile_w2  # noqa: E402


def parse_side(text: str) -> tuple[str, list[str]]:
    name, _, settings = text.partition("=")
    pairs = [s for s in settings.split(",") if s]
    if not name or any("=" not in s for s in pairs):
        raise argparse.ArgumentTypeError(f"--side {text!r}: NAME=key=value[,key=value...]")
    return name, pairs


def main() -> int:
    from airserve.srt.hardware import host_cpu

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", type=parse_side, action="append", required=True,
                   help="NAME=key=value,... (ServerArgs); give two or more")
    profile_w2.add_w2_arguments(p, rounds=4)
    args = p.parse_args()
    if len(args.side) < 2 or len({n for n, _ in args.side}) != len(args.side):
        p.error("give two or more --side, each with its own name")
    engines = {}
    for name, pairs in args.side:
        engine_args = argparse.Namespace(
            mode="compile", path="auto", num_prompts=args.num_prompts,
            input_len=args.input_len, num_threads=args.num_threads,
            graph_bs=[1, 2, 4, 8, 16, 32, 64], server_arg=pairs)
        engines[name] = (engine_args, profile_w2.build_engine(engine_args))
        print(f"built {name}: {pairs}", flush=True)
    names = list(engines)
    runs = profile_w2.ab_rounds(engines, args.rounds, args.output_len,
                                lambda r, i: 7000 + 16 * r + i)
    cpu = host_cpu()[0]
    print(f"\nW2 offline Engines (compile), one process, {cpu}, {args.num_threads} threads, "
          f"{args.rounds} rounds")
    print("| side | settings | wall (s), median | output tok/s, median | prefill forward (s) "
          "| decode forward (s) | vs first (median of per-round wall ratios) |")
    print("|---|---|---|---|---|---|---|")
    summary = profile_w2.ab_medians(
        runs, names, ("wall_s", "output_tok_s", "prefill_forward_s", "decode_forward_s"))
    for name, pairs in args.side:
        med = summary[name]
        print(f"| {name} | {','.join(pairs)} | {med['wall_s']:.2f} | {med['output_tok_s']:.1f} "
              f"| {med['prefill_forward_s']:.2f} | {med['decode_forward_s']:.2f} | "
              f"{med['speedup_vs_first']:.2f}x |")
    if args.json:
        profile_w2.write_ab_json(args.json, cpu, args, runs, summary)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
