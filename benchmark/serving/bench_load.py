"""Serving under load: the prefix cache, chunked prefill and mixed batches, on and off.

For each server configuration it starts `python -m airserve.launch_server`, runs every workload
against it (flushing the prefix cache before each one), stops it, and finally writes into
--output-dir `results.json` (everything measured) and `results.md` (one table), and prints
the table. Workloads:

    gsm8k          few_shot_gsm8k (5 shots share a ~700-token prefix), --parallel P
    gsp            bench_serving --dataset-name generated-shared-prefix
    random-cN      bench_serving random IN/OUT at --max-concurrency N, for each --concurrency
    sharegpt-cN    bench_serving ShareGPT (packaged V3 conversations; outputs capped at
                   --sharegpt-output-len) at --max-concurrency N, for each --concurrency
    poisson        bench_serving random IN/OUT with Poisson arrivals near capacity: at
                   --poisson-fraction of the request throughput the first configuration
                   reached at the largest concurrency (or --request-rate)

Columns: output tok/s, TTFT p50/p99, ITL p50/p99 (ms), the cache hit rate of the run, and
for gsm8k the accuracy and whether greedy answers equal those of the first configuration.
With --rounds N every configuration runs N times, the configurations alternating within each
round; the table shows the median of each column and, for the Poisson run, every round.
Under the table, the Poisson run's steps: mean ms per step of each kind (decode, prefill,
mixed) and band of decode rows, from the server's step spans (every workload's are in the
JSON as `step_spans`).

Usage (the full run; on an otherwise idle machine):
    python benchmark/serving/bench_load.py --output-dir load_results
A quick run with small sizes (a few minutes):
    python benchmark/serving/bench_load.py --small --output-dir load_small
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runners"))

from compare_runners import ModeFailed, Server, get_json  # noqa: E402

from airserve import bench_serving  # noqa: E402
from airserve.benchmark.datasets import load_tokenizer  # noqa: E402
from airserve.srt.managers import step_spans  # noqa: E402
from airserve.test import few_shot_gsm8k  # noqa: E402

# Name -> server flags. The first one is the reference for the answer check and the
# Poisson rate: airserve before the prefix cache and chunked prefill. "budget" is the
# decode-aware prefill budget (--decode-chunked-prefill-size 128, "budget64" 64; off by
# default); the configurations without it say -1 all the same.
NO_BUDGET = ("--decode-chunked-prefill-size", "-1")
BUDGET = ("--decode-chunked-prefill-size", "128")
CONFIGS: dict[str, tuple[str, ...]] = {
    "no-cache": ("--disable-radix-cache", "--chunked-prefill-size", "-1"),
    "radix": ("--chunked-prefill-size", "-1"),
    "radix+chunked": NO_BUDGET,  # the defaults
    "radix+chunked+mixed": ("--enable-mixed-chunk", *NO_BUDGET),
    "radix+chunked+budget": BUDGET,
    "radix+chunked+mixed+budget": ("--enable-mixed-chunk", *BUDGET),
    # A smaller budget: shorter mixed steps (lower ITL tail), more of them per prompt.
    "radix+chunked+mixed+budget64": ("--enable-mixed-chunk", "--decode-chunked-prefill-size",
                                     "64"),
}
WORKLOADS = ("gsm8k", "gsp", "random", "sharegpt", "poisson")
SCHEDULER_COUNTS = ("prefill_tokens", "mixed_steps", "prefill_budget_limited_steps",
                    "interleaved_decode_steps", "retractions")
SMALL = dict(gsm8k_questions=16, gsm8k_parallel=16, gsm8k_max_new_tokens=48, gsp_num_groups=2,
             gsp_prompts_per_group=4, gsp_system_prompt_len=256, gsp_question_len=32,
             gsp_output_len=16, input_len=64, output_len=16, concurrency=[1, 8], num_prompts=8,
             poisson_prompts=12, sharegpt_output_len=16, sharegpt_context_len=512)
COLUMNS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def flush(server: Server) -> None:
    import urllib.request

    req = urllib.request.Request(server.url + "/flush_cache", method="POST")
    with urllib.request.urlopen(req, timeout=30):
        pass


def server_stats(server: Server) -> dict:
    return get_json(server.url + "/get_server_info")["stats"]


def hit_rate(before: dict, after: dict) -> float:
    """Cache hit rate between two snapshots (cached / looked-up prompt tokens)."""
    looked = after["lookup_tokens"] - before["lookup_tokens"]
    return round((after["hit_tokens"] - before["hit_tokens"]) / looked, 4) if looked else 0.0


def bench(server: Server, tokenizer: Any, argv: list[str]) -> dict:
    base = ["--backend", "airserve", "--base-url", server.url, "--disable-tqdm",
            "--warmup-requests", "0"]  # fmt: skip
    ns = bench_serving.build_parser().parse_args(base + argv)
    result = asyncio.run(bench_serving.benchmark(ns, tokenizer))
    return {k: result.get(k) for k in COLUMNS + ("request_throughput", "completed", "failed")}


def gsm8k(server: Server, args: argparse.Namespace, out: Path) -> dict:
    argv = ["--host", "http://127.0.0.1", "--port", server.url.rsplit(":", 1)[1],
            "--num-questions", str(args.gsm8k_questions), "--parallel", str(args.gsm8k_parallel),
            "--max-new-tokens", str(args.gsm8k_max_new_tokens),
            "--result-file", str(out), "--disable-tqdm"]  # fmt: skip
    metrics = asyncio.run(few_shot_gsm8k.run_eval(few_shot_gsm8k.build_parser().parse_args(argv)))
    saved = json.loads(out.read_text(encoding="utf-8"))
    return {**metrics, "outputs": {str(q["index"]): q["output"] for q in saved["questions"]}}


def workloads(args: argparse.Namespace) -> list[tuple[str, list]]:
    """(name, bench_serving argv); the poisson run's --request-rate is appended when known."""
    rand = ["--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
            "--seed", "1"]  # fmt: skip
    gsp = ["--dataset-name", "generated-shared-prefix",
           "--gsp-num-groups", str(args.gsp_num_groups),
           "--gsp-prompts-per-group", str(args.gsp_prompts_per_group),
           "--gsp-system-prompt-len", str(args.gsp_system_prompt_len),
           "--gsp-question-len", str(args.gsp_question_len),
           "--gsp-output-len", str(args.gsp_output_len),
           "--max-concurrency", str(max(args.concurrency))]  # fmt: skip
    out: list[tuple[str, list]] = [("gsm8k", []), ("gsp", gsp)]
    share = ["--dataset-name", "sharegpt", "--sharegpt-output-len", str(args.sharegpt_output_len),
             "--sharegpt-context-len", str(args.sharegpt_context_len), "--seed", "1"]
    for c in args.concurrency:
        n = ["--num-prompts", str(args.num_prompts or args.prompts_per_client * c),
             "--max-concurrency", str(c)]
        out.append((f"random-c{c}", rand + n))
        if args.sharegpt_output_len > 0:
            out.append((f"sharegpt-c{c}", share + n))
    out.append(("poisson", rand + ["--num-prompts", str(args.poisson_prompts)]))
    return [(name, argv) for name, argv in out if name.split("-c")[0] in args.workloads]


def run_config(name: str, args: argparse.Namespace, out_dir: Path, record: dict,
               state: dict) -> None:
    """Every workload against one server; state["rate"] is the Poisson rate, set from this
    configuration's largest-concurrency run when still unknown."""
    flags = list(CONFIGS[name]) + shlex.split(args.server_args)
    record["server_flags"] = flags
    server = Server(flags, args.port, out_dir / f"server_{name}.log")
    with server:
        server.wait_ready(args.startup_timeout)
        info = get_json(server.url + "/get_server_info")
        record["schedule"] = info.get("schedule")
        tokenizer = load_tokenizer(info["tokenizer_path"])
        for workload, argv in workloads(args):
            if workload == "gsm8k" and (args.gsm8k_questions <= 0 or (
                    args.gsm8k_configs and name not in args.gsm8k_configs)):
                continue
            if workload == "poisson":
                top = record["workloads"].get(f"random-c{max(args.concurrency)}") or {}
                if state["rate"] is None and top.get("request_throughput"):
                    state["rate"] = args.poisson_fraction * top["request_throughput"]
                if state["rate"] is None:
                    continue
                argv = argv + ["--request-rate", f"{state['rate']:.4f}"]
            print(f"\n--- {name}: {workload} ---", flush=True)
            flush(server)
            before = server_stats(server)
            if workload == "gsm8k":
                row = gsm8k(server, args, out_dir / f"gsm8k_{name}.json")
            else:
                row = bench(server, tokenizer, argv)
            after = server_stats(server)
            row["cache_hit_rate"] = hit_rate(before["prefix_cache"], after["prefix_cache"])
            # Where this workload's steps went, by kind and decode rows (step_spans.py).
            row["step_spans"] = step_spans.summary(
                step_spans.diff(after["step_spans"], before["step_spans"]))
            record["workloads"][workload] = row
            server.check_alive()
        info = get_json(server.url + "/get_server_info")
        record["eager_fallbacks"] = info["eager_fallbacks"]
        # How often the decode budget cut a prefill step short, over all workloads.
        record["scheduler_counts"] = {k: info["stats"].get(k) for k in SCHEDULER_COUNTS}


def median_records(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per configuration and workload, the median over rounds of each column; the rest of a
    record (spans, flags, counts, gsm8k outputs) from its first round. One round: itself."""
    merged: dict[str, dict] = {}
    for name, first in rounds[0].items():
        rec = merged[name] = {**first, "workloads": {}}
        rec["error"] = next((r[name]["error"] for r in rounds if r[name]["error"]), None)
        for workload, row in first["workloads"].items():
            runs = [r[name]["workloads"][workload] for r in rounds
                    if workload in r[name]["workloads"]]
            rec["workloads"][workload] = {**row, "rounds": len(runs), **{
                c: statistics.median(x[c] for x in runs) for c in COLUMNS
                if all(x.get(c) is not None for x in runs)}}
    return merged


def answers_check(records: dict) -> dict:
    """Whether every configuration's gsm8k outputs equal the first configuration's."""
    outs = {n: r["workloads"].get("gsm8k", {}).get("outputs") for n, r in records.items()}
    outs = {n: o for n, o in outs.items() if o}
    if len(outs) < 2:
        return {}
    ref_name, ref = next(iter(outs.items()))
    return {n: sorted(int(k) for k in ref if o.get(k) != ref[k]) for n, o in outs.items()
            if n != ref_name}


def markdown(records: dict, check: dict, rounds: list[dict[str, dict]]) -> str:
    lines = ["| workload | config | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | "
             "cache hits | gsm8k |", "|" + "---|" * 9]
    order = list(dict.fromkeys(w for r in records.values() for w in r["workloads"]))
    for workload in order:
        for name, rec in records.items():
            row = rec["workloads"].get(workload)
            if row is None:
                continue
            if workload == "gsm8k":
                diff = check.get(name)
                same = "reference" if diff is None else ("identical" if not diff
                                                         else f"{len(diff)} differ")
                cells = [f"{row['output_throughput']:.1f}", "", "", "", "",
                         f"{row['cache_hit_rate']:.0%}", f"acc {row['accuracy']:.3f}, {same}"]
            else:
                cells = [f"{row['output_throughput']:.1f}"] + [
                    f"{row[c]:.0f}" for c in COLUMNS[1:]] + [f"{row['cache_hit_rate']:.0%}", ""]
            lines.append(f"| {workload} | {name} | " + " | ".join(cells) + " |")
    errors = [f"- {n}: {r['error']}" for n, r in records.items() if r.get("error")]
    return "\n".join(lines + rounds_table(rounds) + spans_table(records)
                     + ([""] + errors if errors else [])) + "\n"


def rounds_table(rounds: list[dict[str, dict]], workload: str = "poisson") -> list[str]:
    """Each round's figures of one workload, when there is more than one round."""
    if len(rounds) < 2:
        return []
    lines = ["", f"The {workload} run, round by round:", "",
             "| round | config | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
             "|" + "---|" * 7]
    for r, records in enumerate(rounds, 1):
        for name, rec in records.items():
            row = rec["workloads"].get(workload)
            if row:
                lines.append(f"| {r} | {name} | {row['output_throughput']:.1f} | " + " | ".join(
                    f"{row[c]:.0f}" for c in COLUMNS[1:]) + " |")
    return lines if len(lines) > 5 else []


def spans_table(records: dict, workload: str = "poisson") -> list[str]:
    """Mean per-step spans (ms) of one workload's steps, by kind and running requests."""
    lines = ["", f"Steps of the {workload} run (mean ms per step):", "",
             "| config | step | decode rows | steps | prompt tokens | schedule | forward | "
             "process |", "|" + "---|" * 8]
    for name, rec in records.items():
        for s in rec["workloads"].get(workload, {}).get("step_spans", []):
            lines.append(f"| {name} | {s['kind']} | {s['decode_rows']} | {s['steps']} | "
                         f"{s['mean_prefill_tokens']:.0f} | {s['schedule_ms']} | "
                         f"{s['forward_ms']} | {s['process_ms']} |")
    return lines if len(lines) > 5 else []


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Prefix cache / chunked prefill / mixed batches "
                                            "under load, every configuration in one run.")
    p.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS),
                   help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (poisson alone needs "
                        "--request-rate, or random at some concurrency to set it)")
    p.add_argument("--small", action="store_true", help="small sizes for a quick try: "
                   + ", ".join(f"{k}={v}" for k, v in SMALL.items()))
    p.add_argument("--gsm8k-questions", type=int, default=200, help="0 skips gsm8k")
    p.add_argument("--gsm8k-configs", type=lambda s: s.split(","), default=None,
                   help="run gsm8k on these configs only (comma-separated; default: all)")
    p.add_argument("--gsm8k-parallel", type=int, default=64)
    p.add_argument("--gsm8k-max-new-tokens", type=int, default=512)
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--sharegpt-output-len", type=int, default=128,
                   help="cap on ShareGPT output lengths; 0 skips the ShareGPT workloads")
    p.add_argument("--sharegpt-context-len", type=int, default=2048,
                   help="ShareGPT pairs whose prompt + output exceed this are skipped")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 16, 64])
    p.add_argument("--num-prompts", type=int, default=0,
                   help="random/ShareGPT prompts per concurrency level; default: "
                        "--prompts-per-client x concurrency")
    p.add_argument("--prompts-per-client", type=int, default=4)
    p.add_argument("--poisson-prompts", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson rate (req/s); default: --poisson-fraction of capacity")
    p.add_argument("--poisson-fraction", type=float, default=0.9)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, alternating; the table "
                        "shows medians, the JSON every round")
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--port", type=int, default=31100)
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--output-dir", default="load_results")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.small:
        for key, value in SMALL.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    unknown = sorted((set(args.configs) | set(args.gsm8k_configs or ())) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, dict]] = []
    state = {"rate": args.request_rate}
    # Configurations alternate within each round, so a slow spell of the machine falls on
    # every one of them rather than on whichever ran then.
    for r in range(args.rounds):
        records: dict[str, dict] = {}
        rounds.append(records)
        for name in args.configs:
            record = records[name] = {"workloads": {}, "error": None}
            print(f"\n===== {name} (round {r + 1} of {args.rounds}) =====", flush=True)
            try:
                run_config(name, args, out_dir, record, state)
            except (ModeFailed, bench_serving.BenchmarkError, OSError) as e:
                record["error"] = f"{type(e).__name__}: {e}"
                print(f"config {name} failed: {record['error']}", file=sys.stderr)
    records = median_records(rounds)
    check = answers_check(rounds[0])
    results = {"config": vars(args), "poisson_rate": state["rate"], "records": records,
               "gsm8k_differs": check, "rounds": rounds}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    table = markdown(records, check, rounds)
    (out_dir / "results.md").write_text(table, encoding="utf-8")
    print("\n" + table)
    print(f"wrote {out_dir}/results.json and results.md")
    return 0 if not any(r["error"] for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
