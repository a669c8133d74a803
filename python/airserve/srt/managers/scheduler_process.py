"""The scheduler in its own process: model, KV cache and batching, away from the HTTP loop.

The HTTP process tokenizes and sends requests down a pipe; this process runs
`scheduler.step()` whenever it has work and sends back, per step, one BatchOutput with a
ReqDelta for every request that progressed and a ReqError for every request that failed. The
messages are the dataclasses of `io_struct.py`.

A failure while processing one request fails that request only (the scheduler isolates it);
an exception that escapes a step fails the requests it may have touched and the loop goes on.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection

from airserve.srt.distributed.errors import TensorParallelError
from airserve.srt.managers import io_struct as io
from airserve.srt.managers.validation import check_logprob, validate_request
from airserve.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how long an idle loop waits for a message before checking its parent
STATS_INTERVAL_S = 0.1  # at most this often, a stats snapshot rides along with outputs
# A request that does not stream is answered once, when it finishes: sending it a delta every
# step costs the HTTP process a message per token that nobody reads (~0.9 ms of CPU a token,
# on the cores the decode step runs on). It still gets its first token at once (time to first
# token in /metrics) and then a delta every this many tokens, so /metrics' inter-token latency
# and token counters keep moving on long answers (SGLang forces an output every 50 tokens of a
# non-streaming request for the same reason: DEFAULT_FORCE_STREAM_INTERVAL in its scheduler).
NON_STREAM_INTERVAL = 50


def run_scheduler_process(server_args: ServerArgs, recv_conn: Connection, send_conn: Connection,
                          parent_pid: int) -> None:
    """Process entry point (spawned): load the model, say ready, then serve until told to stop
    or until the parent goes away."""
    # Ctrl-C reaches the whole process group; the HTTP process decides how to shut us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(server_args.log_level, "scheduler")
    try:
        from airserve.srt.managers.engine_core import EngineCore

        core = EngineCore(server_args)
    except Exception as e:  # noqa: BLE001 - any load failure is reported, then we exit
        logger.error("loading the model failed:\n%s", traceback.format_exc())
        _send_quietly(send_conn, io.SchedulerInitError(f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    loop = SchedulerLoop(core, recv_conn, send_conn, parent_pid)
    send_conn.send(io.SchedulerReady(loop.model_info()))
    try:
        loop.run()
        core.model_runner.shutdown()  # stops tensor-parallel ranks, if any
    except (BrokenPipeError, ConnectionResetError):
        logger.info("the HTTP process went away; the scheduler exits")
    except Exception as e:  # noqa: BLE001
        logger.error("the scheduler loop crashed:\n%s", traceback.format_exc())
        _send_quietly(send_conn,
                      io.SchedulerFatal(f"the scheduler crashed: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None


class SchedulerLoop:
    def __init__(self, core, recv_conn: Connection, send_conn: Connection,
                 parent_pid: int) -> None:
        self.core = core  # managers.engine_core.EngineCore
        self.scheduler = core.scheduler
        self.runner = core.model_runner
        self.limits = core.request_limits()
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
        pool = self.core.kv_pool_info()
        return {
            "model_path": resolve_model_path(self.core.server_args.model_path),
            "context_length": runner.context_len,
            "vocab_size": runner.model_config.vocab_size,
            "max_total_tokens": pool["tokens"],
            "kv_pool": pool,
            "max_running_requests": runner.max_running_requests,
            "runner": type(graph).__name__ if graph is not None else "eager",
            "pid": os.getpid(),
            "tp_size": runner.tp.size,
            # This machine's other tensor-parallel ranks (rank 0 is this process).
            "tp_rank_pids": [p.pid for p in runner.tp_procs],
            # Where this replica's ranks met (None without tensor parallelism).
            "dist_init_addr": runner.server_args.dist_init_addr if runner.tp.size > 1 else None,
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
                self._send_outputs(self._step())
            elif self._stats_stale:  # idle now: the last snapshot may predate the last step
                self._send_stats()
            else:
                self.runner.check_tp_ranks()  # a rank that died while idle stops the server
        for rid in list(self.reqs):
            self.scheduler.abort(rid)

    def _step(self) -> list:
        """scheduler.step(), which fails single requests itself; what escapes it fails every
        request that is not waiting (the step may have touched them), and the loop goes on."""
        try:
            return self.scheduler.step()
        except TensorParallelError:
            raise  # the ranks are out of step: the server stops (run_scheduler_process)
        except Exception as e:  # noqa: BLE001 - one bad step must not end the server
            logger.error("a scheduler step failed:\n%s", traceback.format_exc())
            return self.scheduler.fail_unattributed(f"{type(e).__name__}: {e}",
                                                    list(self.reqs.values()))

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

    def _handle(self, msg: object) -> None:
        if isinstance(msg, io.GenerateReqInput):
            self._add(msg)
        elif isinstance(msg, io.AbortReq):
            self.scheduler.abort(msg.rid)
        elif isinstance(msg, (io.ServerInfoReq, io.FlushCacheReq)):
            call = self.call_server_info if isinstance(msg, io.ServerInfoReq) \
                else self.call_flush_cache
            try:
                reply = io.CallReply(msg.token, True, call())
            except Exception as e:  # noqa: BLE001 - a failed call answers, never kills us
                reply = io.CallReply(msg.token, False, f"{type(e).__name__}: {e}")
            self.send_conn.send(reply)
        elif isinstance(msg, io.ShutdownReq):
            self._stopping = True
        else:
            logger.error("unknown message %r ignored", type(msg).__name__)

    def _add(self, msg: io.GenerateReqInput) -> None:
        from airserve.srt.managers.engine_core import build_req

        try:
            params = validate_request(msg.input_ids, msg.sampling_params, self.limits,
                                      parse_grammar=False)
            check_logprob(msg.logprob, len(msg.input_ids), params.max_new_tokens)
            req = build_req(self.core.tokenizer, msg.input_ids, params, rid=msg.rid,
                            stream=msg.stream, logprob=msg.logprob)
            self.scheduler.add_request(req)
        except (ValueError, TypeError, OverflowError) as e:  # the request's fault
            self.send_conn.send(io.BatchOutput(errors=[io.ReqError(msg.rid, 400, str(e))]))
            return
        except Exception as e:  # noqa: BLE001 - ours, but it must not take the server down
            logger.error("request %s could not be added:\n%s", msg.rid, traceback.format_exc())
            self.send_conn.send(io.BatchOutput(
                errors=[io.ReqError(msg.rid, 500, f"{type(e).__name__}: {e}")]))
            return
        self.reqs[msg.rid] = req

    def _send_outputs(self, updated: list) -> None:
        deltas, errors = [], []
        for req in updated:
            if self.reqs.get(req.rid) is not req:
                continue
            if req.finished:
                del self.reqs[req.rid]
            status = (req.finished_reason or {}).get("status_code")
            if status is not None:  # failed while processing: an error, not an output
                errors.append(io.ReqError(req.rid, status, req.finished_reason["message"]))
                continue
            if not (req.finished or req.stream or req.sent_token_len == 0
                    or len(req.output_ids) - req.sent_token_len >= NON_STREAM_INTERVAL):
                continue
            new_ids = req.output_ids[req.sent_token_len:]
            req.sent_token_len = len(req.output_ids)
            text = req.stream_text()
            offset = min(req.sent_text_len, len(text))
            req.sent_text_len = len(text)
            delta = io.ReqDelta(req.rid, new_ids, offset, text[offset:], req.finished_reason,
                                req.cached_tokens)
            if req.logprob is not None:
                take_logprobs(req, delta)
            deltas.append(delta)
        if time.monotonic() - self._last_stats >= STATS_INTERVAL_S:
            self._send_stats(deltas, errors)
        else:
            self._stats_stale = True
            if deltas or errors:
                self.send_conn.send(io.BatchOutput(deltas, errors, None))

    def _send_stats(self, deltas: list | None = None, errors: list | None = None) -> None:
        self.send_conn.send(io.BatchOutput(deltas or [], errors or [], self.stats()))
        self._last_stats = time.monotonic()
        self._stats_stale = False

    # Introspection.
    def stats(self) -> dict:
        alloc = self.runner.allocator
        total = alloc.total_usable_pages * alloc.page_size
        used_pages = (alloc.total_usable_pages - alloc.available_pages()
                      - self.scheduler.kv.cache.evictable_pages())
        return {
            "num_running_reqs": len(self.scheduler.running),
            "num_waiting_reqs": len(self.scheduler.waiting),
            "kv_total_tokens": total,
            # As in SGLang: pages the prefix cache could evict count as available.
            "kv_used_tokens": used_pages * alloc.page_size,
            "kv_used_pages": used_pages,
            "graph_replays": self.runner.graph_replays,
            "eager_fallbacks": dict(self.runner.fallback_counts),
            **self.scheduler.stats,
            "decode_chunked_prefill_size": self.scheduler.config.decode_chunked_prefill_size,
            "prefix_cache": self.scheduler.cache_report(),
            "step_spans": self.scheduler.spans.report(),
        }

    def call_server_info(self) -> dict:
        info = self.core.get_server_info()
        info.update(self.model_info())
        info["stats"] = self.stats()
        return info

    def call_flush_cache(self) -> str:
        self.scheduler.flush_cache()
        return "Cache flushed: the prefix cache is empty and every KV page is free."


def take_logprobs(req, delta: io.ReqDelta) -> None:
    """Move the logprobs `req` gained since its last delta into `delta`."""
    if not req.sent_input_logprobs and req.output_ids:  # the prompt's are complete
        delta.input_logprobs = list(req.input_logprobs)
        req.sent_input_logprobs = True
    delta.output_logprobs = req.output_logprobs[req.sent_output_logprobs:]
    req.sent_output_logprobs = len(req.output_logprobs)


def configure_logging(level: str, who: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"[%(asctime)s {who}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def _send_quietly(conn: Connection, msg: object) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass
