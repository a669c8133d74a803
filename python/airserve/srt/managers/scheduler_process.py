"""The scheduler in its own process: model, KV cache and batching, away from the HTTP loop.

The HTTP process tokenizes and sends requests down a pipe; this process runs
`scheduler.step()` whenever it has work and sends back, per step, one message with a delta
for every request that progressed. Messages are plain tuples (picklable, cheap):

HTTP -> scheduler:
    ("generate", rid, input_ids, sampling_params_dict, stream)
    ("abort", rid)
    ("call", token, name)         name: "server_info" | "flush_cache"
    ("shutdown",)
scheduler -> HTTP:
    ("ready", info)               once, after the model is loaded
    ("init_error", message)       instead of "ready" when loading failed
    ("outputs", deltas, stats)    deltas: [Delta, ...]; stats: dict or None
    ("error", rid, message)       the request was rejected (bad input: HTTP 400)
    ("reply", token, ok, payload)
    ("fatal", message)            the loop crashed; the process exits after sending it

A Delta is (rid, new_output_ids, text_offset, text, finished_reason, cached_tokens): the
client's text becomes `text[:text_offset] + text`, so it stays cumulative without resending
it; cached_tokens counts the prompt tokens the prefix cache supplied.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection

from airserve.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how long an idle loop waits for a message before checking its parent
STATS_INTERVAL_S = 0.1  # at most this often, a stats snapshot rides along with outputs


def run_scheduler_process(server_args: ServerArgs, recv_conn: Connection, send_conn: Connection,
                          parent_pid: int) -> None:
    """Process entry point (spawned): load the model, say ready, then serve until told to stop
    or until the parent goes away."""
    # Ctrl-C reaches the whole process group; the HTTP process decides how to shut us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(server_args.log_level, "scheduler")
    try:
        from airserve.srt.entrypoints.engine import Engine

        kwargs = {f.name: getattr(server_args, f.name) for f in dataclasses.fields(server_args)}
        engine = Engine(**kwargs)
    except Exception as e:  # noqa: BLE001 - any load failure is reported, then we exit
        logger.error("loading the model failed:\n%s", traceback.format_exc())
        _send_quietly(send_conn, ("init_error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    loop = SchedulerLoop(engine, recv_conn, send_conn, parent_pid)
    send_conn.send(("ready", loop.model_info()))
    try:
        loop.run()
    except (BrokenPipeError, ConnectionResetError):
        logger.info("the HTTP process went away; the scheduler exits")
    except Exception as e:  # noqa: BLE001
        logger.error("the scheduler loop crashed:\n%s", traceback.format_exc())
        _send_quietly(send_conn, ("fatal", f"the scheduler crashed: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None


class SchedulerLoop:
    def __init__(self, engine, recv_conn: Connection, send_conn: Connection,
                 parent_pid: int) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.runner = engine.model_runner
        self.recv_conn = recv_conn
        self.send_conn = send_conn
        self.parent_pid = parent_pid
        self.reqs = {}  # rid -> Req, for the requests this loop still reports on
        self._last_stats = 0.0
        self._stats_stale = False  # a step ran since the last stats snapshot was sent
        self._stopping = False

    def model_info(self) -> dict:
        from airserve.srt.model_loader.loader import resolve_model_path

        runner = self.runner
        graph = runner.graph_runner
        return {
            "model_path": resolve_model_path(self.engine.server_args.model_path),
            "context_length": runner.context_len,
            "vocab_size": runner.model_config.vocab_size,
            "max_total_tokens": runner.allocator.total_usable_pages * runner.allocator.page_size,
            "max_running_requests": runner.max_running_requests,
            "runner": type(graph).__name__ if graph is not None else "eager",
            "pid": os.getpid(),
        }

    # The loop.
    def run(self) -> None:
        while not self._stopping:
            idle = not self.scheduler.has_work() and not self._stats_stale
            if not self._receive(IDLE_POLL_S if idle else 0):
                return
            if self._stopping:
                break
            if self.scheduler.has_work():
                self._send_outputs(self.scheduler.step())
            elif self._stats_stale:  # idle now: the last snapshot may predate the last step
                self._send_stats()
        for rid in list(self.reqs):
            self.scheduler.abort(rid)

    def _receive(self, timeout: float) -> bool:
        """Handle every waiting message; False when the parent is gone."""
        try:
            if not self.recv_conn.poll(timeout):
                return os.getppid() == self.parent_pid
            while True:
                self._handle(self.recv_conn.recv())
                if self._stopping or not self.recv_conn.poll(0):
                    return True
        except (EOFError, OSError):
            logger.info("the HTTP process went away; the scheduler exits")
            return False

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "generate":
            self._add(*msg[1:])
        elif kind == "abort":
            self.scheduler.abort(msg[1])
        elif kind == "call":
            _, token, name = msg
            try:
                payload = getattr(self, f"call_{name}")()
                self.send_conn.send(("reply", token, True, payload))
            except Exception as e:  # noqa: BLE001 - a failed call answers, never kills us
                self.send_conn.send(("reply", token, False, f"{type(e).__name__}: {e}"))
        elif kind == "shutdown":
            self._stopping = True
        else:
            logger.error("unknown message %r ignored", kind)

    def _add(self, rid: str, input_ids: list[int], params: dict, stream: bool) -> None:
        from airserve.srt.entrypoints.engine import build_req
        from airserve.srt.sampling.sampling_params import SamplingParams

        try:
            req = build_req(self.engine.tokenizer, input_ids, SamplingParams.from_dict(params),
                            rid=rid, stream=stream)
            self.scheduler.add_request(req)
        except ValueError as e:
            self.send_conn.send(("error", rid, str(e)))
            return
        self.reqs[rid] = req

    def _send_outputs(self, updated: list) -> None:
        deltas = []
        for req in updated:
            if self.reqs.get(req.rid) is not req:
                continue
            new_ids = req.output_ids[req.sent_token_len:]
            req.sent_token_len = len(req.output_ids)
            text = req.stream_text()
            offset = min(req.sent_text_len, len(text))
            req.sent_text_len = len(text)
            deltas.append((req.rid, new_ids, offset, text[offset:], req.finished_reason,
                           req.cached_tokens))
            if req.finished:
                del self.reqs[req.rid]
        if time.monotonic() - self._last_stats >= STATS_INTERVAL_S:
            self._send_stats(deltas)
        else:
            self._stats_stale = True
            if deltas:
                self.send_conn.send(("outputs", deltas, None))

    def _send_stats(self, deltas: list | None = None) -> None:
        self.send_conn.send(("outputs", deltas or [], self.stats()))
        self._last_stats = time.monotonic()
        self._stats_stale = False

    # Introspection.
    def stats(self) -> dict:
        alloc = self.runner.allocator
        total = alloc.total_usable_pages * alloc.page_size
        return {
            "num_running_reqs": len(self.scheduler.running),
            "num_waiting_reqs": len(self.scheduler.waiting),
            "kv_total_tokens": total,
            # As in SGLang: pages the prefix cache could evict count as available.
            "kv_used_tokens": total - alloc.available_tokens()
            - self.scheduler.kv.cache.evictable_pages() * alloc.page_size,
            "graph_replays": self.runner.graph_replays,
            "eager_fallbacks": dict(self.runner.fallback_counts),
            **self.scheduler.stats,
            "prefix_cache": self.scheduler.cache_report(),
        }

    def call_server_info(self) -> dict:
        info = self.engine.get_server_info()
        info.update(self.model_info())
        info["stats"] = self.stats()
        return info

    def call_flush_cache(self) -> str:
        self.scheduler.flush_cache()
        return "Cache flushed: the prefix cache is empty and every KV page is free."


def configure_logging(level: str, who: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"[%(asctime)s {who}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def _send_quietly(conn: Connection, msg: tuple) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass
