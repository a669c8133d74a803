"""/health latency and server memory while large request bodies arrive.

    python benchmark/http/bench_large_bodies.py [--model-path PATH] [--sizes-mb 1 5 25 40]

Starts the server (a tiny random model unless --model-path is given), then for each body kind
(a long text prompt, a long input_ids list) and size sends the body three times from one
thread while another polls /health every 10 ms. Prints a table (status of the big request,
/health p50 and max latency, the HTTP process's RSS before and after) and writes JSON to
--output. Bodies above --max-request-body-bytes (default 32 MiB) are answered 413.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import httpx
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "test"))

from airserve_testing.server_utils import ServerProcess  # noqa: E402
from airserve_testing.tiny_models import make_tiny_model_dir  # noqa: E402


def body(kind: str, size: int) -> bytes:
    if kind == "text":
        return json.dumps({"text": "The quick brown fox. " * (size // 21),
                           "sampling_params": {"max_new_tokens": 1}}).encode()
    return json.dumps({"input_ids": [123] * (size // 5),
                       "sampling_params": {"max_new_tokens": 1}}).encode()


def measure(server: ServerProcess, payload: bytes, repeats: int = 3) -> dict:
    proc = psutil.Process(server.proc.pid)
    rss_before = proc.memory_info().rss
    statuses, latencies = [], []

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=300) as c:
            for _ in range(repeats):
                try:
                    r = c.post("/generate", content=payload,
                               headers={"Content-Type": "application/json"})
                    statuses.append(r.status_code)
                except httpx.HTTPError as e:  # a 413 may close the socket mid-upload
                    statuses.append(type(e).__name__)

    sender = threading.Thread(target=send)
    sender.start()
    with httpx.Client(base_url=server.url, timeout=30) as probe:
        while True:  # at least one probe, however fast the sender is
            t = time.perf_counter()
            probe.get("/health")
            latencies.append(time.perf_counter() - t)
            if not sender.is_alive():
                break
            time.sleep(0.01)
    sender.join()
    return {"statuses": statuses, "health_p50_ms": statistics.median(latencies) * 1e3,
            "health_max_ms": max(latencies) * 1e3, "probes": len(latencies),
            "rss_before_mib": rss_before / 2**20,
            "rss_after_mib": proc.memory_info().rss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 5, 25, 40])
    parser.add_argument("--kinds", nargs="+", default=["text", "input_ids"],
                        choices=["text", "input_ids"])
    parser.add_argument("--output", default="large_bodies.json")
    args = parser.parse_args()
    model = args.model_path or make_tiny_model_dir(tempfile.mkdtemp(), "llama")
    server = ServerProcess(model, api_key=None).wait_ready(timeout=600)
    rows = []
    try:
        for kind in args.kinds:
            for mb in args.sizes_mb:
                payload = body(kind, int(mb * 1e6))
                row = {"kind": kind, "body_mb": len(payload) / 1e6, **measure(server, payload)}
                rows.append(row)
                print(f"{kind:>9} {row['body_mb']:6.1f} MB  statuses {row['statuses']}  "
                      f"/health p50 {row['health_p50_ms']:6.1f} ms  max "
                      f"{row['health_max_ms']:6.1f} ms  RSS {row['rss_before_mib']:.0f} -> "
                      f"{row['rss_after_mib']:.0f} MiB", flush=True)
    finally:
        server.stop()
    with open(args.output, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
