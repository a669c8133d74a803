"""Time and peak memory of building airserve's C++ CPU kernels from scratch, side by side for
several numbers of parallel compiler jobs (MAX_JOBS).

Each configuration builds in a fresh process into an empty TORCH_EXTENSIONS_DIR while a thread
samples the RSS of the process tree (the compilers included) every 50 ms. Prints a table; JSON
with --json. "airserve" leaves MAX_JOBS unset (the build then takes one job per core,
cpu_kernels.build_jobs); "ninja" leaves the number to ninja (its default is above the core
count: 3 on 2 cores), as builds did before; a number sets MAX_JOBS.

    python benchmark/kernels/build_memory.py [--jobs ninja airserve 1] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runners"))

CHILD = ("import sys, time; from airserve.srt.layers import cpu_kernels\n"
         "if sys.argv[1] == 'ninja': cpu_kernels.build_jobs = lambda: None\n"
         "t = time.perf_counter(); ok = cpu_kernels.available(); "
         "print(ok, time.perf_counter() - t)")


def build_once(jobs: str) -> dict:
    from compare_runners import PeakRss

    env = dict(os.environ, TORCH_EXTENSIONS_DIR=tempfile.mkdtemp(prefix="airserve-build-"))
    env.pop("MAX_JOBS", None)
    if jobs not in ("airserve", "ninja"):
        env["MAX_JOBS"] = jobs
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, jobs], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    rss = PeakRss(proc.pid, interval=0.05, counted=lambda p: "cc1plus" in p.name())
    stdout, _ = proc.communicate()
    peak, most = rss.stop(), rss.most
    ok, build_s = stdout.split()
    return {"jobs": jobs, "built": ok == "True", "build_s": round(float(build_s), 1),
            "wall_s": round(time.perf_counter() - start, 1),
            "peak_tree_rss_mib": round(peak), "compilers_at_once": most}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", nargs="+", default=["ninja", "airserve", "1"])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from airserve.srt.hardware import host_cpu

    rows = [build_once(j) for j in a.jobs]
    print(f"C++ kernels build on {host_cpu()[0]} ({os.cpu_count()} cores)")
    print("| MAX_JOBS | built | build (s) | peak RSS, process tree (MiB) | compilers at once |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['jobs']} | {r['built']} | {r['build_s']} | {r['peak_tree_rss_mib']} | "
              f"{r['compilers_at_once']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": host_cpu()[0], "cores": os.cpu_count(), "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
