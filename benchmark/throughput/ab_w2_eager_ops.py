"""W2 in one offline Engine with the C++ operators of eager passes and sampling on, then off,
alternating: one process, one engine, so the machine's drift between minutes hits both sides.

"on" is the build as it runs. "off" puts back the torch ops each operator replaced:
  silu_and_mul   the MLP widens its bf16 gate/up product to float32, then F.silu and a product
  norm_rope      RMSNorm and the rotary embedding of eager passes as torch ops
  argmax_rows    greedy sampling by torch's max(dim).indices
  refine_logits  bf16-rounded top logits left as they are (no float32 refinement)
  prefill_attention  torch's SDPA for prefill attention instead of airserve's C++ operator
                 (the decode graphs keep theirs: they were compiled with it)
  bf16_handoff   RMSNorm and SiLU-and-product hand a bf16 product float32 activations, which it
                 casts itself (RMSNorm.for_product, activation.silu_and_mul_product off; the
                 same bits either way)
Rounds alternate the order (on/off, off/on). `--only NAME ...` switches those alone. Prints a
table and writes JSON.

    python benchmark/throughput/ab_w2_eager_ops.py --rounds 4 --json ab.json
    python benchmark/throughput/ab_w2_eager_ops.py --only prefill_attention --json ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import profile_w2  # noqa: E402


def toggles(engine):
    """name -> (turn on, turn off) for each operator this benchmark switches."""
    import airserve.srt.layers.norm_rope as norm_rope
    import airserve.srt.models.llama as llama
    import airserve.srt.sampling.sampler as sampler

    model = engine.model_runner.model
    refine = model.refine_logits
    backend = engine.model_runner.attn_backend
    built = backend.cpp_built
    mlp, fused, greedy = llama.MLP.forward, norm_rope.fused_eager, sampler.greedy_tokens
    for_product, product = llama.RMSNorm.for_product, llama.silu_and_mul_product

    def torch_mlp(self, x, decode=False, act_dtype=None):
        gate, up = self.gate_up_proj(x, decode).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, decode)

    def float32_handoff():
        llama.RMSNorm.for_product = lambda self, x, consumer, decode: self(x)
        llama.silu_and_mul_product = lambda gate_up, down, decode: None

    def bf16_handoff():
        llama.RMSNorm.for_product, llama.silu_and_mul_product = for_product, product

    def setter(obj, name, value):
        return lambda: setattr(obj, name, value)

    return {
        "silu_and_mul": (setter(llama.MLP, "forward", mlp),
                         setter(llama.MLP, "forward", torch_mlp)),
        "norm_rope": (setter(norm_rope, "fused_eager", fused),
                      setter(norm_rope, "fused_eager", lambda x: False)),
        "argmax_rows": (setter(sampler, "greedy_tokens", greedy),
                        setter(sampler, "greedy_tokens",
                               lambda logits: logits.max(dim=-1).indices.tolist())),
        "refine_logits": (setter(model, "refine_logits", refine),
                          setter(model, "refine_logits", False)),
        "prefill_attention": (setter(backend, "cpp_built", built),
                              setter(backend, "cpp_built", False)),
        "bf16_handoff": (bf16_handoff, float32_handoff),
    }


def main() -> int:
    from airserve.srt.hardware import host_cpu

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    profile_w2.add_w2_arguments(p, rounds=4)
    p.add_argument("--only", nargs="+", default=None, help="switch these operators alone")
    args = p.parse_args()
    engine_args = argparse.Namespace(
        mode="compile", path="auto", num_prompts=args.num_prompts, input_len=args.input_len,
        num_threads=args.num_threads, graph_bs=[1, 2, 4, 8, 16, 32, 64], server_arg=[])
    engine = profile_w2.build_engine(engine_args)
    switches = toggles(engine)
    if args.only:
        unknown = sorted(set(args.only) - set(switches))
        if unknown:
            p.error(f"unknown operator(s) {unknown}; choose from {list(switches)}")
        switches = {name: switches[name] for name in args.only}
    runs = []
    for r in range(args.rounds):
        for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
            for on, off in switches.values():
                (on if side == "on" else off)()
            prompts = profile_w2.make_prompts(engine_args, 5000 + 2 * r + (side == "off"))
            t = profile_w2.time_steps(engine, prompts, args.output_len)
            runs.append(profile_w2.run_record(t, round=r + 1, side=side))
            print(runs[-1], flush=True)
    cpu = host_cpu()[0]
    print(f"\nW2 offline Engine, one process, {cpu}, {args.num_threads} threads")
    print("| side | wall (s), median | output tok/s, median | prefill forward (s) | "
          "decode forward (s) | decode rest of step (s) |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for side in ("on", "off"):
        mine = [x for x in runs if x["side"] == side]
        med = {k: statistics.median(x[k] for x in mine)
               for k in ("wall_s", "output_tok_s", "prefill_forward_s", "decode_forward_s",
                         "decode_rest_s")}
        summary[side] = med
        print(f"| {side} | {med['wall_s']:.2f} | {med['output_tok_s']:.1f} | "
              f"{med['prefill_forward_s']:.2f} | {med['decode_forward_s']:.2f} | "
              f"{med['decode_rest_s']:.2f} |")
    ratio = summary["off"]["wall_s"] / summary["on"]["wall_s"]
    print(f"on is {ratio:.2f}x off (median wall)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cpu": cpu, "args": vars(args), "switched": list(switches), "runs": runs,
            "median": summary, "speedup_on_vs_off": round(ratio, 3)}, indent=1))
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
