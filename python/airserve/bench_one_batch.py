"""Latency of one static batch without a server: prefill, then decode step by step.

Usage:
    python -m airserve.bench_one_batch --batch-size 1 4 16 --input-len 128 --output-len 32 \
        --enable-torch-compile --compare-eager --compare-transformers --result-file out.jsonl

Output follows SGLang's bench_one_batch (prefill and median decode latency/throughput per batch
size). `--compare-eager` runs the same batches eagerly in this process on the same model object
and checks the greedy tokens are identical; `--compare-transformers` times transformers'
`generate` (greedy) on the same weights and threads. The memory-bandwidth bound of a decode step
is the bytes it must read (every weight but the embedding lookup, plus the KV cache) over the
read bandwidth measured here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import time

import torch

from airserve.srt.forward_batch import ForwardMode
from airserve.srt.model_executor.model_runner import ModelRunner
from airserve.srt.server_args import ServerArgs


@dataclasses.dataclass
class BatchResult:
    prefill_latency: float
    decode_latencies: list[float]
    tokens: list[list[int]]  # greedy tokens per request, output_len each

    @property
    def median_decode_latency(self) -> float:
        return statistics.median(self.decode_latencies)


def run_batch(runner: ModelRunner, prompts: list[list[int]], output_len: int) -> BatchResult:
    """Prefill `prompts` together, then `output_len - 1` greedy decode steps (timed each)."""
    alloc, pool = runner.allocator, runner.req_to_token_pool
    bs, lens = len(prompts), [len(p) for p in prompts]
    slots = [pool.allocate() for _ in prompts]
    start = time.perf_counter()
    locs = torch.cat([alloc.allocate(s, 0, n) for s, n in zip(slots, lens)])
    fb = runner.make_forward_batch(
        ForwardMode.EXTEND, input_ids=[t for p in prompts for t in p],
        positions=[i for n in lens for i in range(n)], req_pool_indices=slots, seq_lens=lens,
        out_cache_loc=locs, extend_seq_lens=lens, extend_prefix_lens=[0] * bs,
        last_token_indices=[sum(lens[:i + 1]) - 1 for i in range(bs)])
    next_ids = runner.forward(fb).argmax(-1).tolist()
    prefill = time.perf_counter() - start
    tokens, latencies = [[t] for t in next_ids], []
    for _ in range(output_len - 1):
        start = time.perf_counter()
        locs = torch.cat([alloc.allocate(s, n, n + 1) for s, n in zip(slots, lens)])
        fb = runner.make_forward_batch(
            ForwardMode.DECODE, input_ids=next_ids, positions=lens, req_pool_indices=slots,
            seq_lens=[n + 1 for n in lens], out_cache_loc=locs)
        next_ids = runner.forward(fb).argmax(-1).tolist()
        latencies.append(time.perf_counter() - start)
        lens = [n + 1 for n in lens]
        for seq, t in zip(tokens, next_ids):
            seq.append(t)
    for s, n in zip(slots, lens):
        alloc.free(s, n)
        pool.free(s)
    return BatchResult(prefill, latencies, tokens)


def print_sglang_style(bs: int, input_len: int, r: BatchResult) -> None:
    print(f"Prefill. latency: {r.prefill_latency:6.5f} s, "
          f"throughput: {bs * input_len / r.prefill_latency:9.2f} token/s")
    for i, lat in enumerate(r.decode_latencies[:5]):
        print(f"Decode {i}. Batch size: {bs}, latency: {lat:6.5f} s, "
              f"throughput: {bs / lat:9.2f} token/s")
    med = r.median_decode_latency
    print(f"Decode.  median latency: {med:6.5f} s, median throughput: {bs / med:9.2f} token/s")
    total = r.prefill_latency + sum(r.decode_latencies)
    out_tokens = bs * (input_len + len(r.decode_latencies) + 1)
    print(f"Total. latency: {total:6.3f} s, throughput: {out_tokens / total:9.2f} token/s")


def measure_read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5,
                           device: str = "cpu") -> float:
    """Bytes/s of a streaming read (sum over a tensor larger than the caches) on `device`,
    best of N (float() waits for an accelerator's result)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    float(x.sum())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def kv_bytes_per_token(runner: ModelRunner) -> int:
    k = runner.kv_cache.k_buffers[0]
    return 2 * len(runner.kv_cache.k_buffers) * k[0].numel() * k.element_size()


def transformers_model(runner: ModelRunner):
    """transformers' model for our config, holding a copy of the same weights."""
    import transformers

    cfg = runner.model_config
    hf_cfg = transformers.AutoConfig.for_model(
        cfg.model_type, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).to(runner.dtype)
    missing, unexpected = model.load_state_dict(runner.model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto transformers: {missing[:3]} "
                           f"{unexpected[:3]}")
    return model.eval()


class _StepTimes:
    """A generate() streamer that timestamps each new token (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def time_transformers(model, prompts: list[list[int]], output_len: int):
    """Per-step decode latencies of a greedy generate() and its tokens."""
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
    steps = _StepTimes()
    out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len,
                         streamer=steps, **kw)
    # times[1] follows prefill; each later put follows one decode step.
    latencies = [b - a for a, b in zip(steps.times[1:], steps.times[2:])]
    return latencies, out[:, ids.shape[1]:].tolist()


def bench_args(args: argparse.Namespace) -> ServerArgs:
    server_args = ServerArgs.from_cli_args(args)
    max_bs = max(args.batch_size)
    changes = {}
    if server_args.max_running_requests is None:
        changes["max_running_requests"] = max_bs
    if server_args.max_total_tokens is None:
        changes["max_total_tokens"] = max_bs * (args.input_len + args.output_len) + 256
    return server_args.replace(**changes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--run-name", default="default")
    parser.add_argument("--compare-eager", action="store_true")
    parser.add_argument("--compare-transformers", action="store_true")
    parser.add_argument("--result-file", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    if args.output_len < 2:
        parser.error("--output-len must be at least 2 (one prefill token, one decode step)")
    server_args = bench_args(args)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.1f}: other processes share the cores")

    start = time.perf_counter()
    runner = ModelRunner(server_args)
    startup = time.perf_counter() - start
    report = runner.graph_runner.report() if runner.graph_runner else None
    print(f"start-up: {startup:.1f} s"
          + (f" (capture {report['capture_seconds_total']:.1f} s, buckets {report['buckets']})"
             if report else " (no graph runner)"))
    eager = None
    if args.compare_eager:
        eager = ModelRunner(server_args.replace(enable_torch_compile=False,
                                                disable_cuda_graph=True),
                            model_config=runner.model_config, model=runner.model)
    hf = transformers_model(runner) if args.compare_transformers else None

    bandwidth = measure_read_bandwidth(device=str(runner.device))
    weights = runner.model.decode_weight_bytes(1)
    print(f"threads: {torch.get_num_threads()}, read bandwidth: {bandwidth / 1e9:.1f} GB/s, "
          f"weights read per decode step at bs 1: {weights / 2**20:.1f} MiB "
          f"(float32: {runner.model.decode_weight_bytes(10**9) / 2**20:.1f} MiB), "
          f"weight-only bound: {weights / bandwidth * 1e3:.2f} ms/step")

    g = torch.Generator().manual_seed(server_args.random_seed)
    rows = []
    for bs in args.batch_size:
        prompts = torch.randint(0, runner.model_config.vocab_size, (bs, args.input_len),
                                generator=g).tolist()
        mean_ctx = args.input_len + args.output_len / 2
        bound = (runner.model.decode_weight_bytes(bs)
                 + bs * mean_ctx * kv_bytes_per_token(runner)) / bandwidth
        row = dict(run_name=args.run_name, batch_size=bs, input_len=args.input_len,
                   output_len=args.output_len, bound_latency=bound,
                   bandwidth_gbps=bandwidth / 1e9, threads=torch.get_num_threads(),
                   startup_seconds=startup, graph_runner=report)
        run_batch(runner, prompts, min(4, args.output_len))  # warm-up
        fallbacks = sum(runner.fallback_counts.values())
        print(f"\n== batch size {bs} ({report['runner'] if report else 'eager'}) ==")
        r = run_batch(runner, prompts, args.output_len)
        print_sglang_style(bs, args.input_len, r)
        row.update(_fields(bs, args.input_len, r),
                   decode_fallbacks=sum(runner.fallback_counts.values()) - fallbacks)
        if eager is not None:
            run_batch(eager, prompts, min(4, args.output_len))
            print(f"-- eager, batch size {bs} --")
            e = run_batch(eager, prompts, args.output_len)
            print_sglang_style(bs, args.input_len, e)
            row.update(eager=_fields(bs, args.input_len, e),
                       speedup=e.median_decode_latency / r.median_decode_latency,
                       tokens_match=e.tokens == r.tokens)
        if hf is not None and (bs == 1 or bs * args.input_len <= 8192):
            lats, tokens = time_transformers(hf, prompts, args.output_len)
            row.update(transformers_decode_latency=statistics.median(lats),
                       transformers_min_decode_latency=min(lats),
                       transformers_tokens_match=tokens == r.tokens)
        rows.append(row)
    print_summary(rows)
    if args.result_file:
        with open(args.result_file, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def _fields(bs: int, input_len: int, r: BatchResult) -> dict:
    med = r.median_decode_latency
    total = r.prefill_latency + sum(r.decode_latencies)
    return dict(prefill_latency=r.prefill_latency,
                prefill_throughput=bs * input_len / r.prefill_latency,
                median_decode_latency=med, median_decode_throughput=bs / med,
                min_decode_latency=min(r.decode_latencies),
                overall_latency=total,
                overall_throughput=bs * (input_len + len(r.decode_latencies) + 1) / total)


def print_summary(rows: list[dict]) -> None:
    """Decode ms per step as median / min: the min is the step least disturbed by other load."""
    def ms(row: dict | None, key: str, min_key: str) -> str:
        if not row or key not in row:
            return "-"
        return f"{row[key] * 1e3:.2f} / {row[min_key] * 1e3:.2f}"

    def ratio(num: float | None, den: float) -> str:
        return f"{num / den:.2f}x" if num else "-"

    print("\nDecode ms per step, median / min; speedups and x bound use medians (min in [])")
    print("| bs | prefill ms | graph ms | tok/s | eager ms | vs eager | tokens = eager "
          "| transformers ms | vs transformers | bound ms | x bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        dec, best, bound = (row["median_decode_latency"], row["min_decode_latency"],
                            row["bound_latency"])
        eager, hf = row.get("eager"), row.get("transformers_decode_latency")
        cells = [
            row["batch_size"], f"{row['prefill_latency'] * 1e3:.1f}",
            ms(row, "median_decode_latency", "min_decode_latency"),
            f"{row['median_decode_throughput']:.1f}",
            ms(eager, "median_decode_latency", "min_decode_latency"),
            (f"{ratio(eager['median_decode_latency'], dec)} "
             f"[{ratio(eager['min_decode_latency'], best)}]") if eager else "-",
            ("yes" if row["tokens_match"] else "NO") if eager else "-",
            ms(row, "transformers_decode_latency", "transformers_min_decode_latency"),
            (f"{ratio(hf, dec)} [{ratio(row['transformers_min_decode_latency'], best)}]"
             if hf else "-"),
            f"{bound * 1e3:.2f}", f"{dec / bound:.2f} [{best / bound:.2f}]",
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
