"""Helpers shared by the native and OpenAI endpoints: errors, JSON bodies, SSE, fan-in, and
the two ways an endpoint answers (final outputs as JSON, or an SSE stream of outputs)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from airserve.srt.managers.tokenizer_manager import ReqOutput, RequestError
from airserve.srt.managers.validation import MAX_JSON_DEPTH, FieldError, check_json_value

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error",
                500: "internal_server_error", 503: "service_unavailable"}


def error_body(status: int, message: str) -> dict:
    """OpenAI's error shape; SGLang's clients read `error.message` too."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def parse_json_object(raw: bytes) -> dict:
    """The body as a JSON object, or FieldError/RequestError(400) saying what is wrong with it.
    Refused: NaN and Infinity, integers of thousands of digits, nesting deeper than
    MAX_JSON_DEPTH, lone UTF-16 surrogates. CPU-bound: call it through `off_loop`."""
    if not raw.strip():
        raise RequestError(400, "the request body is empty; send a JSON object")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise RequestError(400, f"the request body is nested too deeply (more than "
                                f"{MAX_JSON_DEPTH} levels are refused)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an int too long to convert
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, not "
                                f"{type(body).__name__}")
    check_json_value(body)
    return body


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a finite number; JSON numbers must be finite")


# Parsing, validation and tokenization run here, not on the event loop: /health and streams
# keep answering while a large body is parsed.
_WORKERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="airserve-parse")


async def off_loop(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` in a worker thread; a FieldError (a request field is wrong) becomes a 400."""
    try:
        return await asyncio.get_running_loop().run_in_executor(_WORKERS, fn, *args)
    except FieldError as e:
        raise RequestError(400, str(e)) from None


def raise_if_aborted(out: ReqOutput) -> None:
    """A request the server stopped (KV cache full, shutdown) is an error, not an answer."""
    reason = out.finished_reason or {}
    if reason.get("type") == "abort":
        raise RequestError(503, f"the request was stopped: {reason.get('message', 'aborted')}")


class ClientDisconnected(Exception):
    pass


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (which aborts its requests) if the client goes away."""
    task = asyncio.ensure_future(awaitable)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done():
            raise ClientDisconnected() from None
        task.cancel()
        raise
    finally:
        watcher.cancel()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave streams of cumulative outputs as (index, item). An item not yet taken is
    replaced by a newer one from its stream (memory stays bounded when the client reads
    slowly). An error in any stream is raised here; closing this iterator cancels, and so
    aborts, all of them."""
    latest: dict[int, T] = {}
    finished: set[int] = set()
    failures: list[Exception] = []
    wake = asyncio.Event()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                latest[i] = item
                wake.set()
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            failures.append(e)
        finally:
            finished.add(i)
            wake.set()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        while True:
            await wake.wait()
            wake.clear()
            if failures:
                raise failures[0]
            for i in sorted(latest):
                if i in latest:
                    yield i, latest.pop(i)
            if len(finished) == len(tasks) and not latest:
                return
    finally:
        # No await here: this must also run when the consumer is being cancelled.
        for task in tasks:
            task.cancel()


def share_prompt(streams: list[AsyncIterator[T]]) -> list[AsyncIterator[T]]:
    """The n streams of one prompt (n > 1): the first runs alone until its first output, when
    its prompt is prefilled and in the prefix cache; then the others start and reuse it."""
    if len(streams) < 2:
        return streams
    prefilled = asyncio.Event()

    async def first() -> AsyncIterator[T]:
        try:
            async for item in streams[0]:
                prefilled.set()
                yield item
        finally:
            prefilled.set()

    async def later(stream: AsyncIterator[T]) -> AsyncIterator[T]:
        await prefilled.wait()
        async for item in stream:
            yield item

    return [first()] + [later(s) for s in streams[1:]]


async def collect_final(streams: list[AsyncIterator[T]]) -> list[T]:
    """The last item of each stream, in stream order."""
    last: list = [None] * len(streams)
    async for i, item in merge(streams):
        last[i] = item
    return last


# How an endpoint answers, streamed or not.
async def final_outputs(request: Request, streams: list[AsyncIterator[ReqOutput]]
                        ) -> list[ReqOutput]:
    """The last output of each stream, in stream order. An aborted request is a RequestError;
    a client that goes away cancels (so aborts) them all."""
    outputs = await until_disconnected(request, collect_final(streams))
    for out in outputs:
        raise_if_aborted(out)
    return outputs


# Turns (stream index, cumulative output) pairs into SSE events.
EventWriter = Callable[[AsyncIterator[tuple[int, ReqOutput]]], AsyncIterator[bytes]]


async def stream_response(request: Request, streams: list[AsyncIterator[ReqOutput]],
                          events: EventWriter) -> StreamingResponse:
    """An SSE response of `events(outputs)`, the outputs of `streams` as `merge` gives them.

    The first output is awaited here, so an error before it (or a client gone) answers the
    request itself. Later, an aborted request or a RequestError becomes an error event; the
    stream always ends with `data: [DONE]`.
    """
    merged = merge(streams)
    first = await until_disconnected(request, anext(merged))
    return StreamingResponse(_sse(merged, first, events), media_type="text/event-stream")


async def _sse(merged: AsyncIterator[tuple[int, ReqOutput]], first: tuple[int, ReqOutput],
               events: EventWriter) -> AsyncIterator[bytes]:
    try:
        async with aclosing(merged), aclosing(events(_checked(merged, first))) as chunks:
            async for chunk in chunks:
                yield chunk
    except RequestError as e:
        yield sse(error_body(e.status, e.message))
    yield SSE_DONE


async def _checked(merged: AsyncIterator[tuple[int, ReqOutput]], first: tuple[int, ReqOutput]
                   ) -> AsyncIterator[tuple[int, ReqOutput]]:
    item: tuple[int, ReqOutput] | None = first
    while item is not None:
        raise_if_aborted(item[1])
        yield item
        item = await anext(merged, None)
