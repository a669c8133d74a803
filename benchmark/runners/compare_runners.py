"""Compare airserve's decode modes on this machine: eager, CPU graph runner, OpenVINO.

For each mode it starts `python -m airserve.launch_server` on the same model, waits until the
server is ready, runs the same `bench_serving` load at each --concurrency and the same
`few_shot_gsm8k` subset, stops the server (SIGTERM, then wait; also on errors and Ctrl-C), and
writes into --output-dir:

    results.json                           everything measured, per mode, and the machine
    results.md                             the comparison table and the greedy-answer check
    output_throughput.png, median_itl.png  per mode, against concurrency
    server_<mode>.log, bench_<mode>.jsonl, gsm8k_<mode>.json   the raw material

Usage (the full comparison: run it on an otherwise idle machine):
    python benchmark/runners/compare_runners.py --output-dir runner_comparison

A mode that fails to start (capture error, missing package) is reported as failed with its
error; OpenVINO is left out by default, and said so, when openvino or its runner is missing.
Needs matplotlib for the plots (`bash scripts/install.sh bench`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from comparison_report import compare_outputs, machine_info, plot_results, write_markdown

from airserve import bench_serving
from airserve.benchmark.backends import ServerUnreachable
from airserve.benchmark.datasets import load_tokenizer
from airserve.test import few_shot_gsm8k

# Mode -> server flags (besides --port, --num-threads and the shared flags).
MODES: dict[str, tuple[str, ...]] = {
    "eager": ("--device", "cpu"),
    "compile": ("--device", "cpu", "--enable-torch-compile"),
    "openvino": ("--device", "cpu", "--enable-torch-compile",
                 "--torch-compile-backend", "openvino"),
}  # fmt: skip
GRAPH_MODES = ("compile", "openvino")


class ModeFailed(RuntimeError):
    """The server of one mode did not start or died; the comparison goes on without it."""



class PeakRss:
    """Peak RSS of a process tree (the process and every descendant), sampled every `interval`
    seconds in a thread until stop(); `most` is the most processes of the tree at once, or of
    those `counted` accepts (e.g. the C++ compilers)."""

    def __init__(self, pid: int, interval: float = 0.2, counted=None) -> None:
        import threading

        import psutil

        self.root, self.peak, self.most = psutil.Process(pid), 0, 0
        self._interval, self._counted = interval, counted or (lambda proc: True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self._interval):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
                self.most = max(self.most, sum(bool(self._counted(p)) for p in procs))
            except psutil.Error:  # a process ended between the listing and the reading
                pass

    def stop(self) -> float:
        """Stop sampling; the peak in MiB."""
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20

def unavailable_reason(mode: str) -> str | None:
    """Why `mode` cannot run on this install, or None."""
    if mode != "openvino":
        return None
    runner_module = "airserve.srt.model_executor.graph_runners.openvino.runner"
    if importlib.util.find_spec(runner_module) is None:
        return "the OpenVINO runner is not part of this airserve build"
    try:
        import openvino  # noqa: F401
    except ImportError as e:
        return f"openvino is not importable ({e}); install it: bash scripts/install.sh openvino"
    return None


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class Server:
    """One `launch_server` process in its own session (so Ctrl-C reaches only this script,
    which then stops the server itself). `stop` sends SIGTERM and waits; SIGKILL on timeout."""

    def __init__(self, flags: list[str], port: int, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.returncode: int | None = None
        cmd = [sys.executable, "-m", "airserve.launch_server", "--host", "127.0.0.1",
               "--port", str(port), *flags]  # fmt: skip
        print(f"$ {shlex.join(cmd)}", flush=True)
        self._log = open(log_path, "w", encoding="utf-8")  # closed by stop()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log_tail(self, lines: int = 25) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ModeFailed(f"the server exited with code {self.proc.returncode}; "
                             f"last lines of {self.log_path}:\n{self.log_tail()}")

    def wait_ready(self, timeout: float) -> float:
        """Seconds from start until GET /health answered 200."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as resp:
                    if resp.status == 200:
                        return time.monotonic() - self.started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise ModeFailed(f"the server was not ready after {timeout:.0f}s (--startup-timeout); "
                         f"last lines of {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                # Stuck, or a second Ctrl-C: take the whole session (scheduler included).
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        self.returncode = self.proc.returncode
        return self.returncode

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_flags(mode: str, args: argparse.Namespace) -> list[str]:
    flags = list(MODES[mode])
    if args.model_path:
        flags += ["--model-path", args.model_path]
    if args.num_threads:
        flags += ["--num-threads", str(args.num_threads)]
    if mode in GRAPH_MODES:
        # Capture up to the largest concurrency so no decode batch falls back to eager.
        flags += ["--torch-compile-max-bs", str(args.torch_compile_max_bs or max(args.concurrency))]
    return flags + shlex.split(args.server_args)


def runner_summary(info: dict) -> dict:
    runner = info.get("graph_runner") or {}
    return {
        "runner": runner.get("runner", "eager"),
        "backend": runner.get("backend"),
        "buckets": runner.get("buckets"),
        "capture_s": runner.get("capture_seconds_total"),
        "model_path": info.get("server_args", {}).get("model_path") or info.get("model_path"),
        "max_total_tokens": info.get("max_total_tokens"),
        "max_running_requests": info.get("server_args", {}).get("max_running_requests"),
        # Prefix cache, chunked prefill and mixed batches, as resolved by the server.
        "schedule": info.get("schedule"),
    }


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return args.num_prompts or max(16, 4 * concurrency)


def run_bench(server: Server, concurrency: int, args: argparse.Namespace, tokenizer: Any,
              out_file: Path) -> dict:
    argv = [
        "--backend", "airserve", "--base-url", server.url, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", str(args.range_ratio),
        "--num-prompts", str(num_prompts(args, concurrency)),
        "--max-concurrency", str(concurrency), "--seed", str(args.seed), "--disable-tqdm",
        "--output-file", str(out_file),
        # Every level re-sends prompts of the same seed: without a flush the prefix cache
        # would serve the later levels' prompts and they would measure decode only.
        "--flush-cache",
    ]  # fmt: skip
    if args.dataset_path:
        argv += ["--dataset-path", args.dataset_path]
    ns = bench_serving.build_parser().parse_args(argv)
    try:
        result = asyncio.run(bench_serving.benchmark(ns, tokenizer))
    except (ServerUnreachable, bench_serving.BenchmarkError) as e:
        server.check_alive()
        return {"max_concurrency": concurrency, "error": str(e)}
    # result["concurrency"] is bench_serving's measured mean concurrency, not the limit.
    return {**result, "max_concurrency": concurrency}


def run_gsm8k(server: Server, args: argparse.Namespace, result_file: Path) -> dict:
    argv = [
        "--host", "http://127.0.0.1", "--port", server.url.rsplit(":", 1)[1],
        "--num-questions", str(args.gsm8k_questions), "--num-shots", str(args.gsm8k_shots),
        "--parallel", str(args.gsm8k_parallel), "--max-new-tokens", str(args.gsm8k_max_new_tokens),
        "--result-file", str(result_file), "--disable-tqdm",
    ]  # fmt: skip
    if args.gsm8k_data_path:
        argv += ["--data-path", args.gsm8k_data_path]
    metrics = asyncio.run(few_shot_gsm8k.run_eval(few_shot_gsm8k.build_parser().parse_args(argv)))
    saved = json.loads(result_file.read_text(encoding="utf-8"))
    # Per-question texts stay in gsm8k_<mode>.json; results.json keeps the index -> output map
    # for the cross-mode check.
    outputs = {str(q["index"]): q["output"] for q in saved["questions"]}
    preds = {str(q["index"]): q["pred"] for q in saved["questions"]}
    return {**metrics, "outputs": outputs, "preds": preds}


def measure(server: Server, record: dict, args: argparse.Namespace, out_dir: Path) -> None:
    mode = record["mode"]
    record["startup_s"] = server.wait_ready(args.startup_timeout)
    info = get_json(server.url + "/get_server_info")
    record.update(runner_summary(info))
    capture = "" if record["capture_s"] is None else f", capture {record['capture_s']}s"
    print(f"ready in {record['startup_s']:.1f}s: runner {record['runner']}{capture}", flush=True)
    tokenizer = load_tokenizer(info["tokenizer_path"])
    for c in args.concurrency:
        print(f"\n--- {mode}: concurrency {c} ---", flush=True)
        record["bench"].append(
            run_bench(server, c, args, tokenizer, out_dir / f"bench_{mode}.jsonl"))
        server.check_alive()
    if args.gsm8k_questions > 0:
        print(f"\n--- {mode}: few-shot GSM8K ---", flush=True)
        record["gsm8k"] = run_gsm8k(server, args, out_dir / f"gsm8k_{mode}.json")
        server.check_alive()
    final = get_json(server.url + "/get_server_info")
    record["eager_fallbacks"] = final.get("eager_fallbacks")
    record["prefix_cache"] = final.get("stats", {}).get("prefix_cache")
    record["replay_count"] = (final.get("graph_runner") or {}).get("replay_count")


def run_mode(record: dict, args: argparse.Namespace, out_dir: Path) -> None:
    """Fills `record` in place, so what was measured survives an error or Ctrl-C; the server
    is stopped (SIGTERM, wait) whatever happens."""
    mode = record["mode"]
    record["server_flags"] = server_flags(mode, args)
    print(f"\n===== mode {mode} =====", flush=True)
    server = None
    try:
        server = Server(record["server_flags"], args.port, out_dir / f"server_{mode}.log")
        with server:
            measure(server, record, args, out_dir)
        record["status"] = "ok"
    except ModeFailed as e:
        record["status"], record["error"] = "failed", str(e)
    except KeyboardInterrupt:
        record["status"], record["error"] = "interrupted", "interrupted"
        raise
    except Exception as e:  # a client or report bug must not hide the other modes' results
        record["status"], record["error"] = "failed", f"{type(e).__name__}: {e}"
    finally:
        record["exit_code"] = server.returncode if server is not None else None
    if record["status"] != "ok":
        print(f"mode {mode} {record['status']}: {record['error']}", file=sys.stderr, flush=True)


def new_record(mode: str) -> dict:
    return {"mode": mode, "status": "pending", "error": None, "bench": [], "gsm8k": None}


def plan_modes(args: argparse.Namespace) -> list[dict]:
    """Records for the modes to run; unavailable ones are marked (never silently dropped)."""
    records = []
    for mode in args.modes or list(MODES):
        record = new_record(mode)
        reason = unavailable_reason(mode)
        if reason is not None:
            # Asked for by name: a failure. Part of the default set: skipped, and said so.
            record["status"] = "failed" if args.modes else "skipped"
            record["error"] = reason
            print(f"mode {mode} {record['status']}: {reason}", file=sys.stderr)
        records.append(record)
    return records


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Run the same load against each decode mode.")
    p.add_argument("--modes", type=lambda s: s.replace(",", " ").split(), default=None,
                   help=f"comma-separated, of {', '.join(MODES)}; default: all "
                        "(openvino when installed)")
    p.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 64],
                   help="bench_serving --max-concurrency values, e.g. 1,4,16,64")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="prompts per concurrency level; default max(16, 4 x concurrency)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=1.0,
                   help="bench_serving --random-range-ratio (1: every request full length)")
    p.add_argument("--dataset-path", default=None, help="text source for random prompts")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gsm8k-questions", type=int, default=200, help="0 skips GSM8K")
    p.add_argument("--gsm8k-shots", type=int, default=5)
    p.add_argument("--gsm8k-parallel", type=int, default=64)
    p.add_argument("--gsm8k-max-new-tokens", type=int, default=512)
    p.add_argument("--gsm8k-data-path", default=None)
    p.add_argument("--model-path", default=None, help="default: the server's default model")
    p.add_argument("--num-threads", type=int, default=None,
                   help="server --num-threads; default: torch's (all cores)")
    p.add_argument("--torch-compile-max-bs", type=int, default=0,
                   help="for graph modes; default: the largest --concurrency")
    p.add_argument("--server-args", default="",
                   help='extra flags for every server: --server-args="--flag value ..."')
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--startup-timeout", type=float, default=3600.0)
    p.add_argument("--output-dir", default="runner_comparison")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the table and plots from --output-dir/results.json; no servers")
    return p


def write_outputs(results: dict, out_dir: Path) -> None:
    results["gsm8k_check"] = compare_outputs(results["modes"])
    (out_dir / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    markdown = write_markdown(results, out_dir / "results.md")
    plot_results(results, out_dir)
    print("\n" + markdown)
    print(f"wrote {out_dir}/results.json, results.md, output_throughput.png, median_itl.png")


def main(argv: list[str] | None = None) -> int:
    """0 when every attempted mode ran, 1 when one failed, 130 when interrupted."""
    args = build_parser().parse_args(argv)
    unknown = sorted(set(args.modes or ()) - set(MODES))
    if unknown:
        build_parser().error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    out_dir = Path(args.output_dir)
    if args.report_only:
        write_outputs(json.loads((out_dir / "results.json").read_text(encoding="utf-8")), out_dir)
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("bench_*.jsonl"):  # bench_serving appends
        stale.unlink()
    results = {"machine": machine_info(), "config": vars(args), "modes": plan_modes(args)}
    interrupted = False
    # `kill` stops the servers like Ctrl-C does. Ctrl-C gets the same handler: with the default
    # one, asyncio.run turns it into a cancellation of the running benchmark task, which that
    # task's request handling can absorb, and the run then went on as if nothing was pressed.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for record in results["modes"]:
            if record["status"] == "pending":
                run_mode(record, args, out_dir)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: servers stopped; writing what was measured", file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    write_outputs(results, out_dir)
    if interrupted:
        return 130
    return 0 if all(r["status"] in ("ok", "skipped") for r in results["modes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
