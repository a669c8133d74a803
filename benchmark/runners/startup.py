"""Cold and warm start-up of the CPU graph runner with the default buckets.

Runs the model runner's start-up (model load, kernels, one compiled decode graph per bucket)
twice in fresh processes on one new compile-cache directory: cold (empty cache), then warm
(the buckets the cold run compiled and stored are loaded, see bucket_store.py). Prints seconds
from launch to a ready runner (`ready_s`, the start-up figure), per phase and per bucket, which
buckets were loaded or compiled, how many graphs, and the bs-1 and largest buckets' replay
times (median and best of direct calls on their static batches); JSON with `--json`.
`--bs1-static` gives bs 1 its own static graph (CPUGraphRunner.share_bs1 = False), to compare.
`--repeat N` runs the cold/warm pair N times. Goals (issue 16): cold <= 60 s, warm <= 10 s.
Each start also reports the peak RSS of its process tree (inductor's compile workers and the C++
compiler included); `--compile-threads airserve 2` compares the runner's choice of inductor
compile threads with a pool of two workers, side by side.

    python benchmark/runners/startup.py [--max-bs 32] [--threads 2] [--bs1-static]
        [--compile-threads airserve 2] [--no-store] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import product


def step_ms(gr, bs: int, steps: int = 100) -> dict | None:
    """Median and best ms of bucket `bs`'s graph called directly on its static batch (the best
    is the figure to compare on a busy machine)."""
    import statistics

    import torch

    if bs not in gr.buckets:
        return None
    if bs not in gr.direct:  # a compiled bucket replays directly after one replay through dynamo
        with torch.inference_mode():
            gr.replay_bucket(bs, gr.inputs.batches[bs])
    direct = gr.direct.get(bs)
    if direct is None:
        return None
    with torch.inference_mode():
        direct()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        with torch.inference_mode():
            direct()
        times.append(time.perf_counter() - t)
    return {"median": round(1e3 * statistics.median(times), 3),
            "min": round(1e3 * min(times), 3)}


def child(max_bs: int, threads: int, cache_dir: str, bs1_static: bool) -> None:
    t0 = time.perf_counter()
    from airserve.srt.model_executor.graph_runners.cpu import CPUGraphRunner
    from airserve.srt.model_executor.model_runner import ModelRunner
    from airserve.srt.server_args import ServerArgs

    CPUGraphRunner.share_bs1 = not bs1_static

    args = ServerArgs(enable_torch_compile=True, torch_compile_max_bs=max_bs,
                      num_threads=threads,
                      compile_cache_dir=None if cache_dir == "none" else cache_dir)
    t_import = time.perf_counter() - t0
    runner = ModelRunner(args)
    gr = runner.graph_runner
    total_s = time.perf_counter() - t0
    ready_at = time.time()  # the parent's start-up figure ends here, before the step timings
    report = gr.report()
    print(json.dumps({"total_s": total_s, "import_s": t_import, "ready_at": ready_at,
                      "capture_s": sum(gr.capture_seconds.values()),
                      "capture_seconds": gr.capture_seconds, "buckets": gr.buckets,
                      "buckets_loaded": report.get("buckets_loaded", []),
                      "buckets_compiled": report.get("buckets_compiled", gr.buckets),
                      "stale_buckets": report.get("stale_buckets", {}),
                      "graphs_compiled": report.get("graphs_compiled"),
                      "graphs_loaded": report.get("graphs_loaded"),
                      "bs1_step_ms": step_ms(gr, 1),
                      "max_bs_step_ms": step_ms(gr, max(gr.buckets), steps=20)}))


def run_once(max_bs: int, threads: int, cache_dir: str, bs1_static: bool,
             compile_threads: str = "airserve") -> dict:
    """One start in a fresh process; `compile_threads` "airserve" leaves inductor's compile
    threads to the runner, a number sets TORCHINDUCTOR_COMPILE_THREADS. Samples the peak RSS of
    the process tree (inductor's compile workers and compilers included) every 0.1 s."""
    from compare_runners import PeakRss

    t0, launched = time.perf_counter(), time.time()
    cmd = [sys.executable, __file__, "--child", "--max-bs", str(max_bs),
           "--threads", str(threads), "--cache-dir", cache_dir]
    env = dict(os.environ)
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    if cache_dir == "none":  # cold: inductor's own caches start empty too
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="airserve-startup-inductor-")
    if compile_threads != "airserve":
        env["TORCHINDUCTOR_COMPILE_THREADS"] = compile_threads
    proc = subprocess.Popen(cmd + (["--bs1-static"] if bs1_static else []), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rss = PeakRss(proc.pid, interval=0.1)
    stdout, stderr = proc.communicate()
    peak = rss.stop()
    if proc.returncode != 0:
        sys.exit(f"start-up child failed ({proc.returncode}):\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0  # with the step timings after start-up
    result["ready_s"] = result["ready_at"] - launched  # launch to a ready runner
    result.update(compile_threads=compile_threads, peak_tree_rss_mib=round(peak),
                  max_processes=rss.most)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-bs", type=int, default=32, help="--torch-compile-max-bs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bs1-static", action="store_true",
                   help="bs 1 compiles its own static graph (the previous default)")
    p.add_argument("--repeat", type=int, default=1, help="cold/warm pairs, each on a new cache")
    p.add_argument("--compile-threads", nargs="+", default=["airserve"],
                   help="inductor compile threads per configuration, side by side: 'airserve' "
                        "(the runner's choice) or a number (TORCHINDUCTOR_COMPILE_THREADS)")
    p.add_argument("--no-store", action="store_true",
                   help="no --compile-cache-dir: cold starts only, compiled through dynamo's "
                        "inductor backend (the path of a server started without the flag)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.max_bs, a.threads, a.cache_dir, a.bs1_static)
    from airserve.srt.hardware import host_cpu

    report = {"cpu": host_cpu()[0], "threads": a.threads, "max_bs": a.max_bs,
              "store": not a.no_store,
              "bs1": "static graph" if a.bs1_static else "shared graph", "runs": [],
              "note": "shared machine: figures are noisy"}
    for _, threads in product(range(a.repeat), a.compile_threads):
        cache_dir = "none" if a.no_store else tempfile.mkdtemp(prefix="airserve-startup-")
        run = {}
        for kind in ("cold",) if a.no_store else ("cold", "warm"):
            r = run[kind] = run_once(a.max_bs, a.threads, cache_dir, a.bs1_static, threads)
            per = ", ".join(f"{bs}: {s:.1f}" for bs, s in sorted(
                (int(k), v) for k, v in r["capture_seconds"].items()))
            print(f"{kind} (compile threads {threads}): peak RSS {r['peak_tree_rss_mib']} MiB "
                  f"over {r['max_processes']} processes, "
                  f"ready {r['ready_s']:.1f} s after launch, in-process "
                  f"{r['total_s']:.1f} s, "
                  f"capture {r['capture_s']:.1f} s (per bucket: {per}; loaded "
                  f"{r['buckets_loaded']}, compiled {r['buckets_compiled']}, graphs compiled "
                  f"{r['graphs_compiled']}); bs-1 step {r['bs1_step_ms']} ms, bs-{a.max_bs} "
                  f"step {r['max_bs_step_ms']} ms", flush=True)
        report["runs"].append(run)
        if not a.no_store:
            shutil.rmtree(cache_dir, ignore_errors=True)
    print("\n| compile threads | start | ready (s) | peak RSS, process tree (MiB) | processes |")
    print("|---|---|---|---|---|")
    for run in report["runs"]:
        for kind, r in run.items():
            print(f"| {r['compile_threads']} | {kind} | {r['ready_s']:.1f} | "
                  f"{r['peak_tree_rss_mib']} | {r['max_processes']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
