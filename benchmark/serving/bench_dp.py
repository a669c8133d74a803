"""Data parallelism against threads: `--dp-size 2 --num-threads 1` vs one replica with 2 threads.

Both configurations get the same CPU cores: two replicas of one torch thread each, or one
replica with two. For each it starts `python -m airserve.launch_server` on the default model,
runs `bench_serving` random IN/OUT prompts at --max-concurrency, reads how the requests were
spread over the replicas (/get_server_info, "replicas"), stops the server, and finally writes
into --output-dir `results.json` and `results.md` (one table), and prints the table.

Usage:
    python benchmark/serving/bench_dp.py --output-dir dp_results
    python benchmark/serving/bench_dp.py --num-prompts 32 --output-len 32   # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runners"))

from compare_runners import ModeFailed, Server, get_json  # noqa: E402

from airserve import bench_serving  # noqa: E402
from airserve.benchmark.datasets import load_tokenizer  # noqa: E402

# Name -> server flags; both use two CPU threads in all.
CONFIGS: dict[str, tuple[str, ...]] = {
    "dp1 x 2 threads": ("--num-threads", "2"),
    "dp2 x 1 thread": ("--dp-size", "2", "--num-threads", "1"),
}
COLUMNS = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
           "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms")


def run_config(name: str, args: argparse.Namespace, out_dir: Path) -> dict:
    flags = list(CONFIGS[name]) + shlex.split(args.server_args)
    slug = name.replace(" ", "_")
    server = Server(flags, args.port, out_dir / f"server_{slug}.log")
    with server:
        server.wait_ready(args.startup_timeout)
        info = get_json(server.url + "/get_server_info")
        tokenizer = load_tokenizer(info["tokenizer_path"])
        before = {r["dp_rank"]: r["dispatched_requests"] for r in info["replicas"]}
        argv = ["--backend", "airserve", "--base-url", server.url, "--disable-tqdm",
                "--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
                "--num-prompts", str(args.num_prompts), "--max-concurrency",
                str(args.max_concurrency), "--seed", "1",
                "--warmup-requests", "2"]  # fmt: skip
        ns = bench_serving.build_parser().parse_args(argv)
        result = asyncio.run(bench_serving.benchmark(ns, tokenizer))
        after = get_json(server.url + "/get_server_info")["replicas"]
        server.check_alive()
    row = {k: result.get(k) for k in COLUMNS + ("completed", "failed", "duration")}
    row["server_flags"] = flags
    # Requests each replica got during the run (the warm-up requests included).
    row["per_replica_requests"] = [r["dispatched_requests"] - before[r["dp_rank"]]
                                   for r in after]
    return row


def markdown(records: dict) -> str:
    head = ("| config | output tok/s | req/s | TTFT p50 (ms) | TTFT p99 | ITL p50 (ms) | "
            "ITL p99 | e2e p50 (ms) | requests per replica |")
    lines = [head, "|" + "---|" * 9]
    for name, row in records.items():
        if row.get("error"):
            lines.append(f"| {name} | failed: {row['error']} |" + " |" * 7)
            continue
        cells = [f"{row[k]:.3f}" if k == "request_throughput" else f"{row[k]:.1f}"
                 if isinstance(row.get(k), (int, float)) else "" for k in COLUMNS]
        spread = " / ".join(map(str, row["per_replica_requests"]))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {spread} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="--dp-size 2 --num-threads 1 against one replica "
                                            "with 2 threads, on the default model.")
    p.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS),
                   help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--server-args", default="", help="extra flags for both servers")
    p.add_argument("--port", type=int, default=31200)
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--output-dir", default="dp_results")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict] = {}
    for name in args.configs:
        print(f"\n===== {name} =====", flush=True)
        try:
            records[name] = run_config(name, args, out_dir)
        except (ModeFailed, bench_serving.BenchmarkError, OSError) as e:
            records[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"config {name} failed: {records[name]['error']}", file=sys.stderr)
        # After every configuration, so an interrupted run keeps what it measured.
        results = {"config": vars(args), "records": records}
        (out_dir / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    table = markdown(records)
    (out_dir / "results.md").write_text(table, encoding="utf-8")
    print("\n" + table)
    print(f"wrote {out_dir}/results.json and results.md")
    return 0 if not any(r.get("error") for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
