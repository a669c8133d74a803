"""Side by side in one process: prefill attention and rotary, the earlier forms against the
ones the model runs now, on one extend of R prompts x L tokens (default: 4 x 128, the CPU
prefill chunk of 512), the default model's heads (9 over 3 KV heads of 64), 30 layers a pass.

  attn_gather   the earlier extend attention: per prompt, K/V gathered from the paged cache by
                advanced indexing, one SDPA call each
  attn_batched  the torch_native backend's path without the C++ operators: prompts without a
                cached prefix, one causal SDPA per prompt length over the new K/V as given
  attn_cpp_ISA  the C++ operator the backend runs when built (`prefill_attention_cpu`), per
                instruction set this CPU has (avx512, avx2, scalar); float32 like SDPA but
                another summation order, so checked against attn_batched within 1e-5
  rope_layer    the earlier rotary: table lookup in every layer, rotate_half in 7 ops
  rope_pass     the model now: lookup once per pass, x * cos + swap_halves(x) * sin

The torch pairs are checked bit for bit equal first; medians of interleaved repeats. Prints a
table, `--json F` writes the figures.

    python benchmark/kernels/bench_prefill_ops.py [--prompts 4] [--len 128] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from airserve.srt.hardware import host_cpu
from airserve.srt.layers import cpu_kernels
from airserve.srt.layers.attention import torch_native_backend as tnb

H, KVH, D, LAYERS, SCALE = 9, 3, 64, 30, 0.125


def make_forms(prompts: int, length: int) -> dict:
    g = torch.Generator().manual_seed(0)
    total, pool = prompts * length, 8 * prompts * length
    q = torch.randn(total, H, D, generator=g)
    k, v = torch.randn(total, KVH, D, generator=g), torch.randn(total, KVH, D, generator=g)
    k_cache = torch.randn(pool, KVH, D, generator=g)
    v_cache = torch.randn(pool, KVH, D, generator=g)
    req_to_token = torch.randperm(pool, generator=g)[:total].view(prompts, length)
    k_cache[req_to_token.flatten()], v_cache[req_to_token.flatten()] = k, v

    def attn_gather():
        out = torch.empty_like(q)
        for i in range(prompts):
            slots, rows = req_to_token[i], slice(i * length, (i + 1) * length)
            keys = k_cache[slots].transpose(0, 1).unsqueeze(0)
            values = v_cache[slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1).unsqueeze(0), keys,
                                               values, is_causal=True, scale=SCALE,
                                               enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)
        return out

    def attn_batched():
        out = torch.empty_like(q)
        tnb._causal_rows(q, k, v, out, [i * length for i in range(prompts)], length, SCALE)
        return out

    pos = torch.arange(total) % length
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = torch.outer(torch.arange(8192, dtype=torch.float32), inv.float())
    cos_h, sin_h = freqs.cos(), freqs.sin()
    cos_f, sin_f = torch.cat((cos_h, cos_h), -1), torch.cat((-sin_h, sin_h), -1)
    tables = (cos_f[pos].unsqueeze(1), sin_f[pos].unsqueeze(1))  # once per pass

    def rope_layer():
        cos, sin = cos_h[pos].unsqueeze(1), sin_h[pos].unsqueeze(1)

        def rot(x):
            x1, x2 = x.float().chunk(2, -1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
        return rot(q), rot(k)

    def rope_pass():
        cos, sin = tables

        def rot(x):
            x1, x2 = x.chunk(2, -1)
            return x * cos + torch.cat((x2, x1), -1) * sin
        return rot(q), rot(k)

    forms = {"attn_gather": attn_gather, "attn_batched": attn_batched,
             "rope_layer": rope_layer, "rope_pass": rope_pass}
    if cpu_kernels.available():
        starts = [i * length for i in range(prompts)]

        def attn_cpp(isa: str):
            def run():
                tnb.use_attention_isa(isa)
                out = torch.empty_like(q)
                torch.ops.airserve.prefill_attention_cpu(out, q, k, v, starts, starts,
                                                         [0] * prompts, [length] * prompts,
                                                         SCALE)
                return out
            return run

        for isa in tnb.attention_isas():
            forms[f"attn_cpp_{isa}"] = attn_cpp(isa)
    return forms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    forms = make_forms(args.prompts, args.len)
    assert torch.equal(forms["attn_gather"](), forms["attn_batched"]())
    assert all(torch.equal(a, b) for a, b in zip(forms["rope_layer"](), forms["rope_pass"]()))
    for name in [n for n in forms if n.startswith("attn_cpp")]:
        assert (forms[name]() - forms["attn_batched"]()).abs().max().item() < 1e-5, name
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.repeats):
        for name, fn in forms.items():
            t = time.perf_counter()
            for _ in range(LAYERS):
                fn()
            times[name].append(time.perf_counter() - t)
    if any(n.startswith("attn_cpp") for n in forms):
        tnb.use_attention_isa("auto")
    cpu = host_cpu()[0]
    print(f"{args.prompts} x {args.len} tokens, {LAYERS} layers, {args.threads} threads, {cpu}")
    print("| form | ms per pass, median | min |")
    print("|---|---|---|")
    rows = {}
    for name, ts in times.items():
        rows[name] = {"median_ms": round(1000 * statistics.median(ts), 2),
                      "min_ms": round(1000 * min(ts), 2)}
        print(f"| {name} | {rows[name]['median_ms']:.1f} | {rows[name]['min_ms']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "args": vars(args), "forms": rows},
                                              indent=1))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
