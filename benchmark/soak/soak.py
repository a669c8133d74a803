"""Soak: bounded load for a while, with clients that disconnect mid-stream, then a leak check.

Starts `python -m airserve.launch_server` on loopback (the default model unless --model-path),
or uses --base-url. `--concurrency` clients each send one streamed /generate request after
another (random prompt ids and lengths, greedy or sampled) until `--duration` seconds have
passed; a fraction `--abort-fraction` of the requests disconnect after a few chunks. Then it
waits for the server to go idle and reads /get_server_info.

Every request ends as exactly one of: completed (a finish reason and [DONE]), aborted (this
client hung up on purpose), errored (an HTTP error or an error event, with its status), or lost
(anything else: a stream that ended without a finish, a timeout, a dropped connection). KV
pages leaked = pages still in use once the server is idle. Prints the figures and writes JSON.

    python benchmark/soak/soak.py --duration 600 --concurrency 64 --abort-fraction 0.33 \\
        --max-total-tokens 16384 --output soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import aiohttp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16, help="clients at once")
    p.add_argument("--abort-fraction", type=float, default=0.33,
                   help="share of requests whose client disconnects mid-stream")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool size of the server this script starts (default: its own)")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--model-path", default=None, help="default: the default model")
    p.add_argument("--num-threads", type=int, default=None, help="server torch threads")
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more server flag (repeatable): --server-arg=--page-size=4")
    p.add_argument("--base-url", default=None, help="use this server instead of starting one")
    p.add_argument("--api-key", default=None)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(4, 64), metavar=("MIN", "MAX"))
    p.add_argument("--max-new-tokens", type=int, nargs=2, default=(4, 48), metavar=("MIN", "MAX"))
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="soak.json")
    args = p.parse_args(argv)
    if not 0 <= args.abort_fraction <= 1:
        p.error("--abort-fraction must be in [0, 1]")
    return args


# The server.
class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.splitext(args.output)[0] + "_server.log"
        if args.base_url:
            self.url = args.base_url.rstrip("/")
            return
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "airserve.launch_server", "--port", str(port)]
        for flag, value in (("--model-path", args.model_path), ("--api-key", args.api_key),
                            ("--max-total-tokens", args.max_total_tokens),
                            ("--max-running-requests", args.max_running_requests),
                            ("--num-threads", args.num_threads)):
            if value is not None:
                cmd += [flag, str(value)]
        cmd += args.server_arg
        print("starting:", " ".join(cmd), f"(log: {self.log_path})", flush=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}; "
                                 f"see {self.log_path}")
            try:
                async with session.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        raise SystemExit(f"the server was not ready in {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One request.
async def one_request(session: aiohttp.ClientSession, url: str, body: dict,
                      abort_after: int | None, timeout: float) -> tuple[str, str | None]:
    """(outcome, detail): outcome is completed | aborted | errored | lost."""
    chunks, finished = 0, False
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url + "/generate", json=body) as r:
                if r.status != 200:
                    return "errored", f"HTTP {r.status}"
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return ("completed", None) if finished else ("lost", "[DONE] early")
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        return "errored", f"event {event['error'].get('code')}"
                    finished = event["meta_info"]["finish_reason"] is not None
                    chunks += 1
                    if abort_after is not None and chunks >= abort_after and not finished:
                        return "aborted", None  # leaving the block closes the connection
        return "lost", "stream ended without [DONE]"
    except TimeoutError:
        return "lost", "timeout"
    except (aiohttp.ClientError, ConnectionError) as e:
        return "lost", type(e).__name__


async def client(session, url: str, args, vocab: int, rng: random.Random, deadline: float,
                 counts: collections.Counter, details: collections.Counter) -> None:
    while time.monotonic() < deadline:
        n = rng.randint(*args.prompt_len)
        params = {"max_new_tokens": rng.randint(*args.max_new_tokens), "ignore_eos": True,
                  "temperature": rng.choice([0.0, 0.8])}
        body = {"input_ids": [rng.randrange(10, vocab) for _ in range(n)],
                "sampling_params": params, "stream": True}
        abort_after = rng.randint(1, 3) if rng.random() < args.abort_fraction else None
        counts["sent"] += 1
        outcome, detail = await one_request(session, url, body, abort_after,
                                            args.request_timeout)
        counts[outcome] += 1
        if detail:
            details[f"{outcome}: {detail}"] += 1


async def wait_idle(session, url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        async with session.get(url + "/get_server_info") as r:
            info = await r.json()
        stats = info.get("stats", {})
        idle = stats.get("num_running_reqs") == 0 and stats.get("num_waiting_reqs") == 0
        if idle or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace, server: Server) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=args.concurrency + 4)
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        await server.wait_ready(session)
        before = await wait_idle(session, server.url)
        vocab = before["vocab_size"]
        counts, details = collections.Counter(), collections.Counter()
        start = time.monotonic()
        deadline = start + args.duration
        await asyncio.gather(*(
            client(session, server.url, args, vocab, random.Random(args.seed * 1000 + i),
                   deadline, counts, details) for i in range(args.concurrency)))
        elapsed = time.monotonic() - start
        await asyncio.sleep(1.0)  # let the server see the last disconnects
        after = await wait_idle(session, server.url)
        async with session.get(server.url + "/health") as r:
            healthy = r.status == 200
    return report(args, counts, details, elapsed, before, after, healthy)


def report(args, counts, details, elapsed, before, after, healthy) -> dict:
    pool = after.get("kv_pool", {})
    page = pool.get("page_size", 1)
    leaked_tokens = after["max_total_tokens"] - after["available_kv_tokens"]
    stats = after.get("stats", {})
    return {
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "elapsed_s": round(elapsed, 1),
        **{k: counts[k] for k in ("sent", "completed", "aborted", "errored", "lost")},
        "details": dict(details),
        "kv_pages_leaked": leaked_tokens // page,
        "kv_pool": pool,
        "server_healthy_after": healthy,
        "server_stats": {k: stats.get(k) for k in (
            "finished_requests", "aborted_requests", "failed_requests", "retractions",
            "generated_tokens", "num_running_reqs", "num_waiting_reqs")},
        "requests_per_s": round(counts["sent"] / elapsed, 2) if elapsed else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = Server(args)
    try:
        result = asyncio.run(soak(args, server))
    finally:
        code = server.stop()
    result["server_exit_code"] = code
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{result['elapsed_s']:.0f}s, concurrency {args.concurrency}, abort fraction "
          f"{args.abort_fraction}: sent {result['sent']}, completed {result['completed']}, "
          f"aborted {result['aborted']}, errored {result['errored']}, lost {result['lost']}; "
          f"KV pages leaked {result['kv_pages_leaked']}; server exit code {code}")
    if result["details"]:
        print("details:", result["details"])
    print("written:", args.output)
    ok = (result["lost"] == 0 and result["kv_pages_leaked"] == 0
          and result["server_healthy_after"] and code in (None, 0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
