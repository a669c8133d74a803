"""Cold and warm start-up of the CPU graph runner with the default buckets.

Runs the model runner's start-up (model load, kernels, one compiled decode graph per bucket)
twice in fresh processes on one new compile-cache directory: cold (empty cache), then warm
(the buckets the cold run compiled and stored are loaded, see bucket_store.py). Prints seconds
per phase and per bucket and which buckets were loaded or compiled; JSON with
`--json`. Goals (issue 16): cold <= 60 s, warm <= 10 s.

    python benchmark/runners/startup.py [--max-bs 32] [--threads 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time


def child(max_bs: int, threads: int, cache_dir: str) -> None:
    t0 = time.perf_counter()
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    args = ServerArgs(enable_torch_compile=True, torch_compile_max_bs=max_bs,
                      num_threads=threads, compile_cache_dir=cache_dir)
    t_import = time.perf_counter() - t0
    runner = ModelRunner(args)
    gr = runner.graph_runner
    report = gr.report()
    print(json.dumps({"total_s": time.perf_counter() - t0, "import_s": t_import,
                      "capture_s": sum(gr.capture_seconds.values()),
                      "capture_seconds": gr.capture_seconds, "buckets": gr.buckets,
                      "buckets_loaded": report.get("buckets_loaded", []),
                      "buckets_compiled": report.get("buckets_compiled", gr.buckets),
                      "stale_buckets": report.get("stale_buckets", {})}))


def run_once(max_bs: int, threads: int, cache_dir: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", "--max-bs", str(max_bs),
                          "--threads", str(threads), "--cache-dir", cache_dir],
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-bs", type=int, default=32, help="--torch-compile-max-bs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.max_bs, a.threads, a.cache_dir)
    from airserve.srt.hardware import host_cpu

    cache_dir = tempfile.mkdtemp(prefix="airserve-startup-")
    report = {"cpu": host_cpu()[0], "threads": a.threads, "max_bs": a.max_bs,
              "note": "one run each; shared machine: figures are noisy"}
    for kind in ("cold", "warm"):
        r = report[kind] = run_once(a.max_bs, a.threads, cache_dir)
        per = ", ".join(f"{bs}: {s:.1f}" for bs, s in sorted(
            (int(k), v) for k, v in r["capture_seconds"].items()))
        print(f"{kind}: process {r['process_s']:.1f} s, capture {r['capture_s']:.1f} s "
              f"(per bucket: {per}; loaded {r['buckets_loaded']}, compiled "
              f"{r['buckets_compiled']})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
