"""Tensor parallel against one rank on a real model: greedy ids and step time.

    python benchmark/parallel/tp_parity.py [--model-path PATH] [--tp-size 3] [--new-tokens 32]
        [--json results/tp_parity.json]

Runs the offline Engine at --tp-size 1, then at --tp-size N (N processes over gloo on this
machine), on the same prompts with greedy decoding and `ignore_eos`; prints whether every
output id matches, and the wall time of each. The default model (SmolLM2-135M, 9 attention
heads, 3 KV heads) splits over 3 ranks, not 2. Exits 1 if any id differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Write a haiku about the sea.", "1, 2, 3, 5, 8,"]


def run(tp: int, args: argparse.Namespace) -> tuple[list[list[int]], float]:
    from airserve.srt.entrypoints.engine import Engine

    engine = Engine(args.model_path, tp_size=tp, num_threads=args.threads,
                    max_total_tokens=2048, max_running_requests=len(PROMPTS))
    params = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(PROMPTS, [params] * len(PROMPTS))
    seconds = time.perf_counter() - start
    engine.shutdown()
    return [o["output_ids"] for o in outs], seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--tp-size", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ref, t1 = run(1, args)
    got, tn = run(args.tp_size, args)
    same = [a == b for a, b in zip(ref, got)]
    print(f"{'prompt':<32} {'ids equal':>9}")
    for prompt, ok in zip(PROMPTS, same):
        print(f"{prompt:<32} {str(ok):>9}")
    print(f"tp 1: {t1:.1f} s, tp {args.tp_size}: {tn:.1f} s for {len(PROMPTS)} x "
          f"{args.new_tokens} tokens ({args.threads} thread(s) per rank)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model_path": args.model_path or "default", "tp_size": args.tp_size,
                       "new_tokens": args.new_tokens, "threads_per_rank": args.threads,
                       "ids_equal": all(same), "per_prompt": same,
                       "seconds": {"tp1": round(t1, 2), f"tp{args.tp_size}": round(tn, 2)}},
                      f, indent=2)
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
