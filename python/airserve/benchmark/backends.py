"""Streaming HTTP clients for one benchmark request, per backend, plus the server probe.

Each request function sends one prompt, reads the server-sent events and returns a
`RequestOutput` with the timings SGLang's bench_serving measures (TTFT, inter-token
latencies, end-to-end latency). A failure never raises: it is recorded in `error`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp

DONE = "[DONE]"


class ServerUnreachable(RuntimeError):
    pass


@dataclass
class RequestInput:
    prompt: str
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    ignore_eos: bool = True


@dataclass
class RequestOutput:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_len: int = 0  # generated tokens, as the server reports them
    start: float = 0.0  # perf_counter when the request was sent
    ttft: float = 0.0  # seconds to the first chunk with text
    latency: float = 0.0  # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between tokens
    error: str = ""


def normalize_base_url(host: str, port: int | None = None) -> str:
    """`127.0.0.1` / `http://127.0.0.1` plus a port -> `http://127.0.0.1:30000`."""
    url = host if "://" in host else f"http://{host}"
    url = url.rstrip("/")
    return f"{url}:{port}" if port is not None else url


def make_session(connect_timeout: float, read_timeout: float) -> aiohttp.ClientSession:
    # total=None: a long generation is fine; what must not happen is a silent stall, so
    # every read (sock_read) and the connect have their own limits.
    timeout = aiohttp.ClientTimeout(
        total=None, connect=connect_timeout, sock_connect=connect_timeout, sock_read=read_timeout
    )
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(timeout=timeout, connector=connector, read_bufsize=10 * 1024**2)


async def probe_server(base_url: str, timeout: float = 5.0) -> list[str]:
    """Model ids from `GET /v1/models`, or [] when only `/health` answers.

    Raises `ServerUnreachable` when neither answers with 200 within `timeout` seconds.
    """
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    errors = []
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        for path in ("/v1/models", "/health"):
            try:
                async with session.get(base_url + path) as resp:
                    if resp.status == 200:
                        if path == "/health":
                            return []
                        data = await resp.json(content_type=None)
                        models = data.get("data") if isinstance(data, dict) else None
                        return [m["id"] for m in models or [] if isinstance(m, dict) and "id" in m]
                    errors.append(f"GET {path}: HTTP {resp.status}")
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                errors.append(f"GET {path}: {type(e).__name__}: {e}")
    raise ServerUnreachable(
        f"no server answering at {base_url} ({'; '.join(errors)}). Start one with "
        "`python -m airserve.launch_server` or point --base-url / --host / --port at it."
    )


async def get_json(base_url: str, path: str, timeout: float = 5.0) -> dict | None:
    """`GET base_url + path` as JSON, or None on any failure."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async with s.get(base_url + path) as resp:
                if resp.status != 200:
                    return None
                return await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def _sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict | str]:
    """Yields each `data:` payload as a dict, and finally the string DONE if it came."""
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line:
            continue
        if not line.startswith("data:"):
            raise ValueError(f"unexpected stream line {line[:200]!r}")
        payload = line[len("data:") :].strip()
        if payload == DONE:
            yield DONE
            return
        data = json.loads(payload)
        if isinstance(data, dict) and "error" in data:
            raise ValueError(f"error in stream: {json.dumps(data['error'])[:500]}")
        yield data


class _Timer:
    """Turns text arrivals into TTFT and inter-token latencies."""

    def __init__(self, out: RequestOutput):
        self.out = out
        self.last = out.start
        self.tokens = 0

    def arrived(self, total_tokens: int) -> None:
        """Text arrived; the server has now produced `total_tokens` tokens in all."""
        now = time.perf_counter()
        if self.out.ttft == 0.0:
            self.out.ttft = now - self.out.start
        else:
            new = total_tokens - self.tokens
            if new <= 0:
                return
            # A chunk carrying several tokens spreads its gap over them, as SGLang does.
            self.out.itl.extend([(now - self.last) / new] * new)
        self.last = now
        self.tokens = total_tokens


def _native_payload(inp: RequestInput) -> dict:
    return {
        "text": inp.prompt,
        "sampling_params": {
            "max_new_tokens": inp.output_len,
            "temperature": 0.0,
            "ignore_eos": inp.ignore_eos,
        },
        "stream": True,
    }


def _completions_payload(inp: RequestInput) -> dict:
    return {
        "model": inp.model,
        "prompt": inp.prompt,
        "max_tokens": inp.output_len,
        "temperature": 0.0,
        "best_of": 1,
        "ignore_eos": inp.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _chat_payload(inp: RequestInput) -> dict:
    return {
        "model": inp.model,
        "messages": [{"role": "user", "content": inp.prompt}],
        "max_tokens": inp.output_len,
        "temperature": 0.0,
        "ignore_eos": inp.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _consume_native(resp: aiohttp.ClientResponse, out: RequestOutput) -> bool:
    """`/generate` stream: `text` and `meta_info.completion_tokens` are cumulative."""
    timer = _Timer(out)
    async for event in _sse_events(resp):
        if event == DONE:
            return True
        tokens = int(event.get("meta_info", {}).get("completion_tokens", out.output_len))
        if event.get("text"):
            out.generated_text = event["text"]
            timer.arrived(tokens)
        out.output_len = tokens
    return False


async def _consume_openai(resp: aiohttp.ClientResponse, out: RequestOutput, chat: bool) -> bool:
    """OpenAI streams: each chunk carries a text delta; `usage` (if sent) has the count."""
    timer = _Timer(out)
    chunks = 0
    usage_tokens = None
    async for event in _sse_events(resp):
        if event == DONE:
            # Without a usage chunk, fall back to the requested length (SGLang's rule).
            out.output_len = usage_tokens if usage_tokens is not None else out.output_len
            return True
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens", usage_tokens)
        choices = event.get("choices") or [{}]
        piece = (choices[0].get("delta") or {}).get("content") if chat else choices[0].get("text")
        if piece:
            chunks += 1
            out.generated_text += piece
            timer.arrived(chunks)
    return False


_CONSUMERS: dict[str, tuple[str, Callable[[RequestInput], dict], Callable[..., Awaitable]]] = {
    "airserve": ("/generate", _native_payload, _consume_native),
    "sglang": ("/generate", _native_payload, _consume_native),
    "openai": ("/v1/completions", _completions_payload, partial(_consume_openai, chat=False)),
    "openai-chat": ("/v1/chat/completions", _chat_payload, partial(_consume_openai, chat=True)),
}
BACKENDS = tuple(_CONSUMERS)


def api_path(backend: str) -> str:
    return _CONSUMERS[backend][0]


async def send_request(
    backend: str, session: aiohttp.ClientSession, inp: RequestInput
) -> RequestOutput:
    """Sends one streamed request and measures it; never raises for a server-side failure."""
    _, build, consume = _CONSUMERS[backend]
    out = RequestOutput(prompt_len=inp.prompt_len, output_len=inp.output_len)
    out.start = time.perf_counter()
    try:
        async with session.post(inp.api_url, json=build(inp)) as resp:
            if resp.status != 200:
                body = (await resp.text())[:500]
                out.error = f"HTTP {resp.status} from {inp.api_url}: {body}"
                return out
            finished = await consume(resp, out)
        out.latency = time.perf_counter() - out.start
        if not finished:
            out.error = f"stream from {inp.api_url} ended before `data: {DONE}`"
        else:
            out.success = True
            if out.ttft == 0.0:  # no text at all (e.g. EOS first without ignore_eos)
                out.ttft = out.latency
    except TimeoutError:
        out.error = f"timed out waiting for {inp.api_url} (see --request-timeout)"
    except (aiohttp.ClientError, ValueError, KeyError, TypeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def first_error(outputs: list[Any]) -> str:
    """First error among failed outputs, for printing."""
    for o in outputs:
        if not o.success and o.error:
            return o.error
    return ""
