"""W1 (one stream: a 32-token prompt, 256 greedy tokens) on offline Engines built in one process
under different decode-activation rules, runs alternating (rotating, with more than two
sides: profile_w2.ab_rounds), so that the machine's drift between minutes hits every side
alike.

Each `--side NAME=RULE` builds an Engine in compile mode (the CPU graph runner, bucket 1) with
`--cpu-decode-activations` RULE: `float32`, `int8`, `int16`, `auto`, `auto-no-int16` (auto as
it was before int16 activations: int8 in the Q4_1 / Q8_0 gate/up projections, float32 in the
other Q4_1 layers; block_matvec.AUTO_INT16_KINDS emptied while that engine builds and runs), or
`auto-int16:KIND+KIND` (auto with int16 for those kinds only, e.g. `auto-int16:q4_1+q4_k+q6_k`,
a candidate rule against the shipped one).
Prints each side's median decode tok/s and its ratio to the first side's, and writes JSON.

    python benchmark/throughput/ab_w1_activations.py --side before=auto-no-int16 \
        --side int16=auto --rounds 6 --json ab.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

import fidelity  # noqa: E402
import profile_w2  # noqa: E402

RULES = ("float32", "int8", "int16", "auto", "auto-no-int16")


def rule(name: str):
    """A context within which `auto` takes int16 as rule `name` says: for no kind under
    "auto-no-int16", for the named kinds under "auto-int16:A+B", as shipped otherwise (the
    kinds are read when a product is traced or runs; fidelity.auto_rules swaps them)."""
    kinds = (frozenset() if name == "auto-no-int16"
             else frozenset(name.split(":", 1)[1].split("+")) if name.startswith("auto-int16:")
             else None)
    return fidelity.auto_rules(None, kinds)


def parse_side(text: str) -> tuple[str, str]:
    name, _, value = text.partition("=")
    if not name or (value not in RULES and not value.startswith("auto-int16:")):
        raise argparse.ArgumentTypeError(f"--side {text!r}: NAME=RULE, RULE one of {RULES}")
    return name, value


def main() -> int:
    from airserve.srt.hardware import host_cpu

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", type=parse_side, action="append", required=True)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--gguf-type", default="Q4_1",
                   help="the default model's GGUF in this type (bench_w1.py's --gguf-type: "
                        "Q4_1 is the packaged file, others are made once with llama.cpp)")
    p.add_argument("--gguf-dir", default="~/.cache/airserve/w1_gguf")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if len(args.side) < 2 or len({n for n, _ in args.side}) != len(args.side):
        p.error("give two or more --side, each with its own name")
    model = []
    if args.gguf_type != "Q4_1":
        import bench_w1

        path = bench_w1.gguf_file(args.gguf_type, args.gguf_dir, args.num_threads)
        model = [f"model_path={path}"]
    engines = {}
    for name, value in args.side:
        engine_args = argparse.Namespace(
            mode="compile", path="auto", num_prompts=1, input_len=args.input_len,
            num_threads=args.num_threads, graph_bs=[1],
            server_arg=[f"cpu_decode_activations={value.split('-')[0]}", *model])
        with rule(value):
            engines[name] = (engine_args, profile_w2.build_engine(engine_args))
        print(f"built {name}: {value}", flush=True)
    names = list(engines)
    rules = dict(args.side)
    runs = profile_w2.ab_rounds(engines, args.rounds, args.output_len,
                                lambda r, i: 9000 + r, lambda name: rule(rules[name]))
    cpu = host_cpu()[0]
    print(f"\nW1 offline Engines (compile, bucket 1), one process, {cpu}, {args.num_threads} "
          f"threads, {args.rounds} rounds")
    print("| side | rule | output tok/s, median | decode forward (s), median "
          "| vs first (median of per-round wall ratios) |")
    print("|---|---|---|---|---|")
    summary = profile_w2.ab_medians(runs, names, ("output_tok_s", "decode_forward_s"))
    for name, value in args.side:
        med = summary[name] = {"rule": value, **summary[name]}
        print(f"| {name} | {value} | {med['output_tok_s']:.1f} | {med['decode_forward_s']:.3f} "
              f"| {med['speedup_vs_first']:.2f}x |")
    if args.json:
        profile_w2.write_ab_json(args.json, cpu, args, runs, summary)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
