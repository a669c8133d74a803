"""The checks every HTTP request passes before a route sees it (an ASGI middleware).

In order: the Host header must name this server (against DNS rebinding: a web page whose name
resolves to 127.0.0.1 must not reach a local server), the API key (when the server has one; on
every path but `/health`, a liveness probe that runs nothing), a JSON Content-Type on the JSON
endpoints (a web page can post a body without one, or as text/plain, without a CORS
preflight), and the body size: a Content-Length above the limit is answered 413 before the body
is read, and a body that grows past it while streaming stops being read with a 413.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable

from fastapi.responses import JSONResponse

from airserve.srt.entrypoints.http_utils import error_body
from airserve.srt.managers.tokenizer_manager import RequestError

logger = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
JSON_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
OPEN_PATHS = frozenset({"/health"})  # answered without the API key


def allowed_hosts(bound_host: str, extra: Iterable[str] | None) -> frozenset[str] | None:
    """Host names requests may address (lower case, no port); None allows any. A server bound
    to every interface allows any unless `extra` (--allowed-hosts) lists names."""
    extra = [h.strip().lower() for h in extra or () if h.strip()]
    if "*" in extra:
        return None
    if bound_host in WILDCARD_HOSTS and not extra:
        return None
    return frozenset({*LOOPBACK_NAMES, bound_host.lower().strip("[]"), *extra})


def host_name(header: str) -> str:
    """`example.com:30000` -> `example.com`; `[::1]:30000` -> `::1`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    """Pure ASGI middleware: see the module docstring."""

    def __init__(self, app, *, hosts: frozenset[str] | None, api_key: str | None,
                 max_body_bytes: int) -> None:
        self.app = app
        self.hosts = hosts
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            status, message = refusal
            response = JSONResponse(error_body(status, message), status_code=status,
                                    headers={"connection": "close"} if status == 413 else None)
            await response(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _refusal(self, scope, headers: dict[str, str]) -> tuple[int, str] | None:
        host = host_name(headers.get("host", ""))
        if self.hosts is not None and host not in self.hosts:
            return 400, (f"Host {host or '(none)'!r} is not served here; add it to "
                         "--allowed-hosts to reach this server by that name")
        path = scope["path"]
        if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(
                headers.get("authorization", "")):
            return 401, ("invalid or missing API key: send the header "
                         "'Authorization: Bearer <the server's --api-key>'")
        if scope["method"] == "POST" and path in JSON_PATHS:
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                return 415, (f"Content-Type {kind or '(none)'!r} is not accepted; send the body "
                             "as JSON with 'Content-Type: application/json'")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return 413, self._too_large(f"{int(length)} bytes")
        return None

    def _authorized(self, header: str) -> bool:
        scheme, _, key = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(key.strip().encode(), self.api_key)

    def _too_large(self, size: str) -> str:
        return (f"the request body ({size}) is larger than the server's limit of "
                f"{self.max_body_bytes} bytes (--max-request-body-bytes)")

    def _limited(self, receive):
        """`receive`, raising RequestError(413) once the body passes the limit; the body read
        so far is dropped with the request."""
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise RequestError(413, self._too_large(f"more than {seen} bytes"))
            return message

        return limited
