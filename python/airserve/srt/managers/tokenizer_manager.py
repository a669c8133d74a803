"""The HTTP process's half of the engine: tokenizer, scheduler processes, per-request streams.

Like SGLang's TokenizerManager: prompts are tokenized here, sent to a scheduler process
(`scheduler_process.py`, which owns the model), and the per-step deltas that come back are
folded into one state per request that an HTTP handler awaits. With `--dp-size N` there are N
scheduler processes (`data_parallel.py`); each request goes to the least loaded one. Two
threads per scheduler move messages between the event loop and its pipes, so the loop never
blocks on a scheduler.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from airserve.srt.managers import io_struct as io
from airserve.srt.managers.data_parallel import OpenReq, Replica, check_threads, pick_replica
from airserve.srt.sampling.logprobs import LogprobParams, TokenLogprob
from airserve.srt.server_args import ServerArgs
from airserve.srt.tokenizer import Tokenizer, get_tokenizer

logger = logging.getLogger(__name__)

# The HTTP process exits with this code when a scheduler process dies (README: "Failures"),
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
    replica: Replica  # the scheduler process that owns it
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
        self.info: dict = {}  # from replica 0's "ready" message
        self.ready = False  # set by the server after warm-up
        self.dead: str | None = None  # why a scheduler process is gone
        self.shutting_down = False
        self.replicas = [Replica(rank, server_args) for rank in range(server_args.dp_size)]
        self._states: dict[str, _ReqState] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._next_replica = itertools.count()  # where pick_replica starts looking
        self._loop: asyncio.AbstractEventLoop | None = None

    # Life cycle.
    async def start(self) -> None:
        """Spawn the scheduler processes, load the tokenizer meanwhile, wait until every one
        is ready."""
        from airserve.srt.model_loader.model_path import resolve_model_path

        args = self.server_args
        resolve_model_path(args.model_path)  # fail fast, before spawning anything
        warning = check_threads(args.dp_size, args.num_threads, os.cpu_count(), args.tp_size)
        if warning:
            logger.warning("%s", warning)
        self._loop = loop = asyncio.get_running_loop()
        for replica in self.replicas:
            replica.start()
        self.tokenizer = await loop.run_in_executor(
            None, get_tokenizer, args.tokenizer_path or args.model_path)
        for replica in self.replicas:
            await loop.run_in_executor(None, replica.wait_ready)
        self.info = self.replicas[0].info
        for replica in self.replicas:
            replica.start_reading(self._post_message, self._post_dead)

    def begin_shutdown(self) -> None:
        """Refuse new requests and end every open one (their streams close)."""
        self.shutting_down = True
        for state in list(self._states.values()):
            self._fail(state, RequestError(503, "the server is shutting down"))

    def close(self, timeout: float = 5.0) -> None:
        """Stop the scheduler processes (politely, then by force) and wait for them."""
        self.shutting_down = True
        for replica in self.replicas:
            replica.close(timeout)

    @property
    def stats(self) -> dict:
        """Replica 0's latest stats snapshot (`replica_stats()` has every replica's)."""
        return self.replicas[0].stats

    def replica_stats(self) -> list[dict]:
        return [replica.stats for replica in self.replicas]

    def load_report(self) -> list[dict]:
        """Per replica: the dispatcher's queued tokens and open requests, the scheduler's
        running/waiting counts, KV use and cache hit rate (latest snapshot)."""
        return [replica.report() for replica in self.replicas]

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
                       logprob: LogprobParams | None = None,
                       dp_rank: int | None = None) -> AsyncIterator[ReqOutput]:
        """Yields the request's cumulative output after each step that changed it; the last one
        is finished. Raises RequestError when the scheduler rejects or loses it. Closing the
        iterator early aborts the request (its KV pages are freed). `dp_rank` sends it to that
        replica (SGLang's `data_parallel_rank`); by default it goes to the least loaded one."""
        self._check_available()
        rid = rid or uuid.uuid4().hex
        if rid in self._states:
            raise RequestError(400, f"rid {rid!r} is already in use")
        replica = self._replica_for(dp_rank)
        state = _ReqState(rid, len(input_ids), replica)
        self._states[rid] = state
        replica.open_reqs[rid] = OpenReq(len(input_ids), self._max_new_tokens(
            sampling_params, len(input_ids)))
        replica.dispatched += 1
        replica.send(io.GenerateReqInput(rid, list(input_ids), sampling_params, stream,
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
            replica.open_reqs.pop(rid, None)
            if state.finished_reason is None and state.error is None and not self.dead:
                replica.send(io.AbortReq(rid))

    def _replica_for(self, dp_rank: int | None) -> Replica:
        if dp_rank is None:
            return pick_replica(self.replicas, next(self._next_replica) % len(self.replicas))
        if not 0 <= dp_rank < len(self.replicas):
            raise RequestError(400, f"data_parallel_rank: {dp_rank} is not a replica of this "
                                    f"server (--dp-size {len(self.replicas)}: 0.."
                                    f"{len(self.replicas) - 1})")
        return self.replicas[dp_rank]

    def _max_new_tokens(self, sampling_params: dict, prompt_tokens: int) -> int:
        """What the request may produce at most, for the dispatcher's count."""
        asked = sampling_params.get("max_new_tokens")
        room = max(self.info.get("context_length", 0) - prompt_tokens, 0)
        return room if asked is None else min(asked, room)

    async def call(self, name: str, timeout: float = 10.0) -> list[tuple[bool, object]]:
        """Ask every scheduler process something (`name`: server_info, flush_cache); one
        (ok, payload) per replica, in rank order."""
        self._check_available()
        return list(await asyncio.gather(*(self._call_one(replica, name, timeout)
                                           for replica in self.replicas)))

    async def _call_one(self, replica: Replica, name: str, timeout: float) -> tuple[bool, object]:
        token = next(self._tokens)
        future = self._loop.create_future()
        self._calls[token] = future
        kinds = {"server_info": io.ServerInfoReq, "flush_cache": io.FlushCacheReq}
        replica.send(kinds[name](token))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise RequestError(503, f"{replica.name} did not answer {name} within "
                                    f"{timeout:.0f}s") from None
        finally:
            self._calls.pop(token, None)

    def _check_available(self) -> None:
        if self.dead:
            raise RequestError(503, self.dead)
        if self.shutting_down:
            raise RequestError(503, "the server is shutting down")

    # Messages from the scheduler processes (read on their threads, handled on the loop).
    def _post_message(self, replica: Replica, msg: object) -> None:
        self._loop.call_soon_threadsafe(self._on_message, replica, msg)

    def _post_dead(self, replica: Replica, exitcode: int | None) -> None:
        self._loop.call_soon_threadsafe(self._on_dead, replica, exitcode)

    def _on_message(self, replica: Replica, msg: object) -> None:
        if isinstance(msg, io.BatchOutput):
            self._on_outputs(replica, msg.deltas)
            for error in msg.errors:
                state = self._states.get(error.rid)
                if state is not None:
                    self._fail(state, RequestError(error.status, error.message))
            if msg.stats is not None:
                replica.stats = msg.stats
        elif isinstance(msg, io.CallReply):
            future = self._calls.get(msg.token)
            if future is not None and not future.done():
                future.set_result((msg.ok, msg.payload))
        elif isinstance(msg, io.SchedulerFatal):
            replica.fatal = msg.message
        else:
            logger.error("unknown message %r from %s ignored", type(msg).__name__, replica.name)

    def _on_outputs(self, replica: Replica, deltas: list[io.ReqDelta]) -> None:
        now = time.perf_counter()
        for delta in deltas:
            new_ids, finished_reason = delta.new_output_ids, delta.finished_reason
            state = self._states.get(delta.rid)
            if state is None:  # aborted here already
                continue
            counted = replica.open_reqs.get(delta.rid)
            if counted is not None:
                counted.output_tokens += len(new_ids)
                if finished_reason is not None:
                    del replica.open_reqs[delta.rid]
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

    def _on_dead(self, replica: Replica, exitcode: int | None) -> None:
        if self.dead is not None:  # another replica went first; its message stands
            return
        if self.shutting_down and replica.fatal is None:
            self.dead = "the server is shutting down"
        else:
            reason = replica.fatal or f"{replica.name} died ({_exit_text(exitcode)})"
            if replica.fatal and len(self.replicas) > 1:
                reason = f"data-parallel replica {replica.rank}: {reason}"
            self.dead = reason + "; restart the server"
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
