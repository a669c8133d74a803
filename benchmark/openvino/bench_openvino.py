"""OpenVINO decode against eager, the CPU inductor runner and transformers, on the default model.

Each configuration runs in a fresh process (compiles, caches and memory do not mix), using
`airserve.bench_one_batch`'s batch loop (prefill, then greedy decode steps, each timed):

    python benchmark/openvino/bench_openvino.py --output openvino_bench.json

Table 1: decode step time per batch size (median and best over all timed steps of --repeats
batches) for eager, the inductor runner, OpenVINO f32 / bf16 hint / f16 (with --dtype float16),
and transformers eager on the same weights and threads (batch 1); compile seconds per bucket.
Table 2: the OpenVINO step at batch 1 with a small and a large KV pool (--max-total-tokens).
Other processes skew every number: before each configuration the script waits (--wait-idle)
until the cores are idle, and each row records the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS: dict[str, dict] = {
    "eager": {},
    "inductor": {"enable_torch_compile": True},
    "openvino_f32": {"enable_torch_compile": True, "torch_compile_backend": "openvino"},
    "openvino_bf16": {"enable_torch_compile": True, "torch_compile_backend": "openvino",
                      "openvino_precision": "bf16"},
    "openvino_f16": {"enable_torch_compile": True, "torch_compile_backend": "openvino",
                     "openvino_precision": "f16", "dtype": "float16"},
    "transformers": {},
}


def worker(spec: dict) -> dict:
    """Run one configuration in this process; returns per-batch-size step times."""
    import time

    import torch

    from airserve.bench_one_batch import run_batch, time_transformers, transformers_model
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    bss, name = spec["batch_sizes"], spec["config"]
    tokens = spec["max_total_tokens"] or max(bss) * (spec["input_len"] + spec["output_len"]) + 256
    kwargs = dict(CONFIGS[name], num_threads=spec["threads"], max_total_tokens=tokens,
                  max_running_requests=max(bss), cuda_graph_bs=tuple(bss))
    start = time.perf_counter()
    runner = ModelRunner(ServerArgs(**kwargs))
    out = {"config": name, "startup_s": time.perf_counter() - start, "rows": [],
           "max_total_tokens": tokens,
           "kv_pool_mib": runner.kv_pool.memory_bytes() / 2**20}
    report = runner.graph_runner.report() if runner.graph_runner else {}
    hf = transformers_model(runner) if name == "transformers" else None
    g = torch.Generator().manual_seed(0)
    for bs in bss:
        prompts = torch.randint(0, runner.model_config.vocab_size, (bs, spec["input_len"]),
                                generator=g).tolist()
        load = os.getloadavg()[0]
        if hf is not None:
            steps = [time_transformers(hf, prompts, spec["output_len"])[0]
                     for _ in range(spec["repeats"])]
        else:
            run_batch(runner, prompts, 4)  # warm-up
            steps = [lat for _ in range(spec["repeats"])
                     for lat in run_batch(runner, prompts, spec["output_len"]).decode_latencies]
        out["rows"].append({
            "batch_size": bs, "median_ms": 1e3 * statistics.median(steps),
            "best_ms": 1e3 * min(steps), "load": load,
            "compile_s": report.get("capture_seconds", {}).get(bs),
            "fallbacks": sum(runner.fallback_counts.values()),
        })
    return out


def cpu_busy(seconds: float = 3.0) -> float:
    """Fraction of all cores busy over `seconds` (from /proc/stat)."""
    import time

    def sample():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_for_idle(max_wait: float, busy_below: float = 0.15) -> float:
    """Wait (up to `max_wait` s) until other processes leave the cores idle; returns the last
    busy fraction seen."""
    import time

    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    while busy >= busy_below and time.monotonic() < deadline:
        busy = cpu_busy()
    return busy


def run(name: str, args, batch_sizes: list[int], max_total_tokens: int | None) -> dict:
    spec = {"config": name, "batch_sizes": batch_sizes, "input_len": args.input_len,
            "output_len": args.output_len, "repeats": args.repeats, "threads": args.threads,
            "max_total_tokens": max_total_tokens}
    busy = wait_for_idle(args.wait_idle)
    print(f"[cores {busy:.0%} busy before, load {os.getloadavg()[0]:.1f}] {name} "
          f"bs={batch_sizes} max_total_tokens={max_total_tokens}", flush=True)
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{name} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_tables(results: dict[str, dict], pools: list[dict], batch_sizes: list[int]) -> None:
    names = list(results)
    rows = {n: {r["batch_size"]: r for r in results[n]["rows"]} for n in names}
    print("\ndecode step, ms: median (best); compile s per bucket in [ ]")
    print("| bs | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for bs in batch_sizes:
        cells = []
        for n in names:
            r = rows[n].get(bs)
            if r is None:
                cells.append("-")
                continue
            compiled = f" [{r['compile_s']:.0f}]" if r.get("compile_s") else ""
            cells.append(f"{r['median_ms']:.1f} ({r['best_ms']:.1f}){compiled}")
        print(f"| {bs} | " + " | ".join(cells) + " |")
    ov = rows.get("openvino_f32", {})
    for other in ("eager", "inductor", "transformers"):
        ratios = [f"bs {bs}: {rows[other][bs]['median_ms'] / ov[bs]['median_ms']:.2f}x"
                  for bs in batch_sizes if bs in rows.get(other, {}) and bs in ov]
        if ratios:
            print(f"OpenVINO f32 speed-up over {other} (median): {', '.join(ratios)}")
    if pools:
        print("\n| config | --max-total-tokens | KV pool MiB | decode ms bs 1: median (best) |")
        print("|---|---|---|---|")
        for p in pools:
            r = p["rows"][0]
            print(f"| {p['config']} | {p['max_total_tokens']} | {p['kv_pool_mib']:.0f} | "
                  f"{r['median_ms']:.1f} ({r['best_ms']:.1f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                        default=["openvino_f32", "eager", "inductor", "transformers",
                                 "openvino_bf16", "openvino_f16"])
    parser.add_argument("--pool-sizes", type=int, nargs="*", default=[4096, 65536],
                        help="--max-total-tokens for the pool-size table (batch 1)")
    parser.add_argument("--pool-configs", nargs="*", choices=list(CONFIGS),
                        default=["openvino_f32", "openvino_bf16", "openvino_f16"])
    parser.add_argument("--wait-idle", type=float, default=600,
                        help="seconds to wait for idle cores before each configuration")
    parser.add_argument("--output", default="openvino_bench.json")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    results = {}
    for name in args.configs:
        bss = [1] if name == "transformers" else args.batch_sizes
        results[name] = run(name, args, bss, None)
    pools = [run(name, args, [1], size) for name in args.pool_configs for size in args.pool_sizes]
    print_tables(results, pools, args.batch_sizes)
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "results": results, "pools": pools}, f, indent=1)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
