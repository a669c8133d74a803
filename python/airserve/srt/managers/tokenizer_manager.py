"""The HTTP process's half of the engine: tokenizer, scheduler process, per-request streams.

Like SGLang's TokenizerManager: prompts are tokenized here, sent to the scheduler process
(`scheduler_process.py`, which owns the model), and the per-step deltas that come back are
folded into one state per request that an HTTP handler awaits. Two threads move messages
between the event loop and the pipes, so the loop never blocks on the scheduler.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from airserve.srt.managers import io_struct as io
from airserve.srt.managers.scheduler_process import run_scheduler_process
from airserve.srt.sampling.logprobs import LogprobParams, TokenLogprob
from airserve.srt.server_args import ServerArgs
from airserve.srt.tokenizer import Tokenizer, get_tokenizer

logger = logging.getLogger(__name__)

# The HTTP process exits with this code when its scheduler process dies (README: "Failures"),
# after giving the in-flight requests' error answers this long to go out.
SCHEDULER_DIED_EXIT_CODE = 1
EXIT_GRACE_S = 1.0


class RequestError(Exception):
    """A request failed; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ReqOutput:
    """What a request has produced so far (text and ids are cumulative)."""

    rid: str
    text: str
    completion_tokens: int
    prompt_tokens: int
    finished_reason: dict | None
    e2e_latency: float
    cached_tokens: int  # prompt tokens served from the prefix cache
    # Shared with the request state, which only appends to it: slice it, never mutate it.
    all_ids: list[int] = field(repr=False)
    # Logprob requests only (shared the same way; `output_logprobs` may run ahead of
    # `completion_tokens`): None until the prompt's logprobs arrived with the first token.
    input_logprobs: list[TokenLogprob] | None = field(default=None, repr=False)
    all_output_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)

    @property
    def output_logprobs(self) -> list[TokenLogprob]:
        return self.all_output_logprobs[:self.completion_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[:self.completion_tokens]

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None


@dataclass(eq=False)
class _ReqState:
    rid: str
    prompt_tokens: int
    created: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict | None = None
    error: RequestError | None = None
    last_token_time: float | None = None
    cached_tokens: int = 0
    event: asyncio.Event = field(default_factory=asyncio.Event)
    # One snapshot per scheduler message not yet yielded: a stream sends every step, even when
    # several arrive before the client's coroutine runs again.
    pending: list[ReqOutput] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] | None = None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)

    def snapshot(self) -> ReqOutput:
        return ReqOutput(self.rid, self.text, len(self.output_ids), self.prompt_tokens,
                         self.finished_reason, time.perf_counter() - self.created,
                         self.cached_tokens, self.output_ids, self.input_logprobs,
                         self.output_logprobs)


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, metrics=None) -> None:
        self.server_args = server_args
        self.metrics = metrics  # airserve.srt.metrics.ServerMetrics or None
        self.tokenizer: Tokenizer | None = None
        self.info: dict = {}  # from the scheduler's "ready" message
        self.stats: dict = {}  # the latest scheduler stats snapshot
        self.ready = False  # set by the server after warm-up
        self.dead: str | None = None  # why the scheduler process is gone
        self.shutting_down = False
        self._states: dict[str, _ReqState] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._fatal: str | None = None
        self._proc = None
        self._outbox: queue.Queue = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None

    # Life cycle.
    async def start(self) -> None:
        """Spawn the scheduler process, load the tokenizer meanwhile, wait until it is ready."""
        from airserve.srt.model_loader.loader import resolve_model_path

        resolve_model_path(self.server_args.model_path)  # fail fast, before spawning anything
        self._loop = loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")  # never fork a process that may hold torch threads
        req_recv, self._req_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=run_scheduler_process, name="airserve-scheduler",
                                 args=(self.server_args, req_recv, out_send, os.getpid()))
        self._proc.start()
        req_recv.close()
        out_send.close()
        threading.Thread(target=self._send_loop, name="airserve-send", daemon=True).start()
        args = self.server_args
        self.tokenizer = await loop.run_in_executor(
            None, get_tokenizer, args.tokenizer_path or args.model_path)
        self.info = await loop.run_in_executor(None, self._wait_ready)
        threading.Thread(target=self._read_loop, name="airserve-recv", daemon=True).start()

    def _wait_ready(self) -> dict:
        while not self._out_recv.poll(0.5):
            if not self._proc.is_alive():
                raise RuntimeError(f"the scheduler process exited (code {self._proc.exitcode}) "
                                   "while loading the model; see its log above")
        try:
            msg = self._out_recv.recv()
        except EOFError:
            self._proc.join(1.0)
            raise RuntimeError(f"the scheduler process exited (code {self._proc.exitcode}) "
                               "while loading the model; see its log above") from None
        if not isinstance(msg, io.SchedulerReady):
            raise RuntimeError(f"loading the model failed: {getattr(msg, 'message', msg)}")
        return msg.info

    def begin_shutdown(self) -> None:
        """Refuse new requests and end every open one (their streams close)."""
        self.shutting_down = True
        for state in list(self._states.values()):
            self._fail(state, RequestError(503, "the server is shutting down"))

    def close(self, timeout: float = 5.0) -> None:
        """Stop the scheduler process (politely, then by force) and wait for it."""
        self.shutting_down = True
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.is_alive() and self.info:
            self._outbox.put(io.ShutdownReq())
            self._outbox.put(None)
            proc.join(timeout)
        elif proc.is_alive():  # still loading the model: nothing to finish politely
            timeout = 0
        if proc.is_alive():
            if timeout:
                logger.warning("the scheduler process did not stop in %.0fs; terminating it",
                               timeout)
            proc.terminate()
            proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join()

    @property
    def scheduler_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def unhealthy_reason(self) -> str | None:
        if self.dead:
            return self.dead
        if self.shutting_down:
            return "the server is shutting down"
        if not self.ready:
            return "the server is starting (warm-up not finished)"
        return None

    # Requests.
    async def generate(self, input_ids: list[int], sampling_params: dict, stream: bool = False,
                       rid: str | None = None,
                       logprob: LogprobParams | None = None) -> AsyncIterator[ReqOutput]:
        """Yields the request's cumulative output after each step that changed it; the last one
        is finished. Raises RequestError when the scheduler rejects or loses it. Closing the
        iterator early aborts the request (its KV pages are freed)."""
        self._check_available()
        rid = rid or uuid.uuid4().hex
        if rid in self._states:
            raise RequestError(400, f"rid {rid!r} is already in use")
        state = _ReqState(rid, len(input_ids))
        self._states[rid] = state
        self._outbox.put(io.GenerateReqInput(rid, list(input_ids), sampling_params, stream,
                                             logprob))
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                if state.error is not None:
                    raise state.error
                outputs, state.pending = state.pending, []
                for out in outputs:
                    yield out
                    if out.finished:
                        return
        finally:
            self._states.pop(rid, None)
            if state.finished_reason is None and state.error is None and not self.dead:
                self._outbox.put(io.AbortReq(rid))

    async def call(self, name: str, timeout: float = 10.0) -> tuple[bool, object]:
        """Ask the scheduler process something (`name`: server_info, flush_cache)."""
        self._check_available()
        token = next(self._tokens)
        future = self._loop.create_future()
        self._calls[token] = future
        kinds = {"server_info": io.ServerInfoReq, "flush_cache": io.FlushCacheReq}
        self._outbox.put(kinds[name](token))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise RequestError(503, f"the scheduler did not answer {name} within "
                                    f"{timeout:.0f}s") from None
        finally:
            self._calls.pop(token, None)

    def _check_available(self) -> None:
        if self.dead:
            raise RequestError(503, self.dead)
        if self.shutting_down:
            raise RequestError(503, "the server is shutting down")

    # Messages from the scheduler process (on the event loop).
    def _on_message(self, msg: object) -> None:
        if isinstance(msg, io.BatchOutput):
            self._on_outputs(msg.deltas)
            for error in msg.errors:
                state = self._states.get(error.rid)
                if state is not None:
                    self._fail(state, RequestError(error.status, error.message))
            if msg.stats is not None:
                self.stats = msg.stats
        elif isinstance(msg, io.CallReply):
            future = self._calls.get(msg.token)
            if future is not None and not future.done():
                future.set_result((msg.ok, msg.payload))
        elif isinstance(msg, io.SchedulerFatal):
            self._fatal = msg.message
        else:
            logger.error("unknown message %r from the scheduler ignored", type(msg).__name__)

    def _on_outputs(self, deltas: list[io.ReqDelta]) -> None:
        now = time.perf_counter()
        for delta in deltas:
            new_ids, finished_reason = delta.new_output_ids, delta.finished_reason
            state = self._states.get(delta.rid)
            if state is None:  # aborted here already
                continue
            if new_ids and self.metrics is not None:
                if state.last_token_time is None:
                    self.metrics.observe_ttft(now - state.created)
                else:
                    self.metrics.observe_itl((now - state.last_token_time) / len(new_ids),
                                             len(new_ids))
            if new_ids:
                state.last_token_time = now
            state.output_ids.extend(new_ids)
            if delta.input_logprobs is not None:
                state.input_logprobs = delta.input_logprobs
            state.output_logprobs.extend(delta.output_logprobs)
            state.cached_tokens = delta.cached_tokens
            state.text = state.text[:delta.text_offset] + delta.text
            if finished_reason is not None:
                state.finished_reason = finished_reason
                if self.metrics is not None:
                    self.metrics.observe_finished(state.prompt_tokens, len(state.output_ids),
                                                  now - state.created, finished_reason["type"])
            state.pending.append(state.snapshot())
            state.event.set()

    def _on_dead(self, exitcode: int | None) -> None:
        if self.shutting_down and self._fatal is None:
            self.dead = "the server is shutting down"
        else:
            self.dead = (self._fatal or f"the scheduler process died ({_exit_text(exitcode)})") \
                + "; restart the server"
        for state in list(self._states.values()):
            self._fail(state, RequestError(500, self.dead))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(RequestError(503, self.dead))
        if not self.shutting_down:
            # No zombie: a server without its scheduler can serve nothing. Let the failed
            # requests' answers go out, then exit non-zero so that a supervisor restarts it.
            logger.error("%s: failed %d in-flight requests; the server exits with code %d in "
                         "%.0fs", self.dead, len(self._states), SCHEDULER_DIED_EXIT_CODE,
                         EXIT_GRACE_S)
            self.shutting_down = True
            self._loop.call_later(EXIT_GRACE_S, _exit_now, SCHEDULER_DIED_EXIT_CODE)

    @staticmethod
    def _fail(state: _ReqState, error: RequestError) -> None:
        if state.error is None and state.finished_reason is None:
            state.error = error
            state.event.set()

    # The two pipe threads.
    def _read_loop(self) -> None:
        try:
            while True:
                msg = self._out_recv.recv()
                self._loop.call_soon_threadsafe(self._on_message, msg)
        except (EOFError, OSError):
            pass
        except RuntimeError:  # the event loop is closed: the server is gone already
            return
        proc = self._proc
        if proc is not None:
            proc.join(1.0)
        exitcode = proc.exitcode if proc is not None else None
        try:
            self._loop.call_soon_threadsafe(self._on_dead, exitcode)
        except RuntimeError:
            pass

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._req_send.send(msg)
            except OSError:  # the scheduler is gone; the read loop reports it
                return


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _exit_now(code: int) -> None:
    """Leave at once: uvicorn's graceful shutdown would return exit code 0."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
