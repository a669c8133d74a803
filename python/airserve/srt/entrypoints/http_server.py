"""The HTTP server: FastAPI routes over a TokenizerManager, served by uvicorn.

Process layout (as SGLang): this process runs the event loop, tokenizes, and streams
responses; the model, KV cache and batching live in the scheduler process
(`managers/scheduler_process.py`; one per replica with --dp-size), so `/health` answers while
a batch decodes. The routes SGLang's router calls on its workers (`/health`, `/server_info`,
`/model_info`, `/get_load`, `/flush_cache`, the generate routes) answer as SGLang's do.
SIGINT/SIGTERM end every open request (streams get an error event and `[DONE]`), stop uvicorn,
then stop the scheduler processes; the server exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from airserve import __version__
from airserve.srt.entrypoints import native_api
from airserve.srt.entrypoints.http_guard import RequestGuard, allowed_hosts
from airserve.srt.entrypoints.http_utils import ClientDisconnected, error_response
from airserve.srt.entrypoints.openai_api import OpenAIServing
from airserve.srt.hardware import discover_in_child
from airserve.srt.managers.tokenizer_manager import RequestError, TokenizerManager
from airserve.srt.managers.validation import RequestLimits
from airserve.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
WARMUP_TIMEOUT_S = 600.0  # the first decode may compile graphs


def model_names(args: ServerArgs, resolved_path: str) -> tuple[str, ...]:
    """Names a request's `model` may use; the first is the one every response reports:
    --served-model-name, else the model's file or directory name (never a local path).
    "default" always works (SGLang's protocol default), so clients need not know the name."""
    served = args.served_model_name or os.path.basename(os.path.normpath(resolved_path))
    names = [served, args.model_path, resolved_path, "default"]
    return tuple(dict.fromkeys(n for n in names if n))


def create_app(manager: TokenizerManager, args: ServerArgs, metrics=None,
               devices: dict | None = None) -> FastAPI:
    """The routes. `devices`: `airserve.srt.hardware.discover()`, found once at start-up and served
    in /get_server_info."""
    app = FastAPI(title="airserve", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    names = model_names(args, manager.info["model_path"])
    limits = RequestLimits.for_model(manager.tokenizer, manager.info["vocab_size"],
                                     manager.info["context_length"],
                                     manager.info["max_total_tokens"])
    openai = OpenAIServing(manager, names, limits)
    hosts = allowed_hosts(args.host, args.allowed_hosts)
    if hosts is None and args.api_key is None:
        logger.warning("requests may use any Host name and need no API key; set --api-key "
                       "(and --allowed-hosts) when this port is reachable from other machines")
    app.add_middleware(RequestGuard, hosts=hosts, api_key=args.api_key,
                       max_body_bytes=args.max_request_body_bytes)
    _add_error_handlers(app)
    _add_health_routes(app, manager)
    _add_info_routes(app, manager, args, names, devices)
    _add_admin_routes(app, manager, metrics)

    @app.post("/generate")
    async def generate(request: Request):
        return await native_api.generate(request, manager, limits)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai.chat(request)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is a JSON body with the status (`error_response`); a client that left gets
    nothing."""

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError):
        response = error_response(e.status, e.message)
        if e.status == 413:  # the rest of the body is not worth reading
            response.headers["connection"] = "close"
        return response

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(_: Request, e: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; the request was aborted

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return error_response(400, str(e))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}")


def _add_health_routes(app: FastAPI, manager: TokenizerManager) -> None:
    @app.get("/health")
    async def health():
        reason = manager.unhealthy_reason()
        if reason is not None:
            return error_response(503, reason)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        reason = manager.unhealthy_reason()
        if reason is not None:
            return error_response(503, reason)
        ids = manager.tokenizer.encode("ping")[:4] or [0]
        try:
            await asyncio.wait_for(_drain(manager.generate(ids, {"max_new_tokens": 1})),
                                   HEALTH_GENERATE_TIMEOUT_S)
        except (RequestError, TimeoutError) as e:
            return error_response(503, f"generation failed: {e or 'timed out'}")
        return Response(status_code=200)


def _add_info_routes(app: FastAPI, manager: TokenizerManager, args: ServerArgs,
                     names: tuple[str, ...], devices: dict | None) -> None:
    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{
            "id": names[0], "object": "model", "created": int(time.time()),
            "owned_by": "airserve", "root": names[0],
            "max_model_len": manager.info["context_length"]}]}

    # /model_info and /server_info: the names SGLang's router asks its workers.
    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info():
        path = manager.info["model_path"]
        return {"model_path": path, "tokenizer_path": args.tokenizer_path or path,
                "served_model_name": names[0], "is_generation": True,
                "context_length": manager.info["context_length"]}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info():
        replies = await manager.call("server_info")
        for rank, (ok, info) in enumerate(replies):
            if not ok:
                raise RequestError(500, f"replica {rank}'s scheduler could not report: {info}")
        # Replica 0's report at the top (the only one without --dp-size), every replica's
        # load under "replicas".
        info = {"version": __version__, "served_model_name": names[0],
                "tokenizer_path": args.tokenizer_path or manager.info["model_path"],
                **replies[0][1], "dp_size": args.dp_size,
                "replicas": [{**load, "kv_pool": info["kv_pool"],
                              "prefix_cache": info["prefix_cache"],
                              **{k: info[k] for k in ("tp_size", "tp_rank_pids",
                                                      "dist_init_addr")}}
                             for load, (_, info) in zip(manager.load_report(), replies)],
                "server_args": _server_args_dict(args), "devices": devices}
        # Runner reports may hold non-JSON values (dtypes, devices): show them as text.
        return JSONResponse(json.loads(json.dumps(info, default=str)))

    @app.get("/get_load")
    async def get_load():
        """SGLang's shape: one entry per data-parallel rank."""
        return [{"dp_rank": r["dp_rank"], "num_reqs": r["open_requests"],
                 "num_waiting_reqs": r["num_waiting_reqs"], "num_tokens": r["queued_tokens"]}
                for r in manager.load_report()]


def _add_admin_routes(app: FastAPI, manager: TokenizerManager, metrics) -> None:
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        replies = await manager.call("flush_cache")
        failed = [f"replica {rank}: {message}" if len(replies) > 1 else message
                  for rank, (ok, message) in enumerate(replies) if not ok]
        if failed:
            raise RequestError(400, f"cache not flushed: {'; '.join(failed)}")
        return PlainTextResponse(replies[0][1])

    @app.get("/metrics")
    async def prometheus_metrics():
        if metrics is None:
            raise RequestError(404, "metrics are off; start the server with --enable-metrics")
        from airserve.srt.metrics import CONTENT_TYPE

        return Response(metrics.render(), media_type=CONTENT_TYPE)


async def _drain(stream) -> None:
    async with contextlib.aclosing(stream):
        async for _ in stream:
            pass


def _server_args_dict(args: ServerArgs) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("extra", "api_key")}


# Serving.
class _UvicornServer(uvicorn.Server):
    """uvicorn, but it tells us about SIGINT/SIGTERM first and does not re-raise the signal
    after a graceful shutdown (we clean up and return instead)."""

    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def launch_server(args: ServerArgs) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit code."""
    sock = _bind(args.host, args.port)
    manager = TokenizerManager(args)
    # Until uvicorn takes over the signals, SIGTERM interrupts model loading like Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return asyncio.run(_serve(args, manager, sock))
    except KeyboardInterrupt:
        logger.info("interrupted before the server was up")
        return 130
    except (RuntimeError, OSError, ValueError) as e:  # startup failed; the log says more
        logger.error("the server did not start: %s", e)
        return 1
    finally:
        manager.close()
        sock.close()
        signal.signal(signal.SIGTERM, previous)


async def _serve(args: ServerArgs, manager: TokenizerManager, sock: socket.socket) -> int:
    # Discovery takes seconds (OpenVINO's plugins, a child process probing torch-npu): once, in
    # a thread waiting on its child process, while the scheduler process loads the model.
    devices = asyncio.create_task(asyncio.to_thread(_discover_devices))
    await manager.start()
    metrics = None
    if args.enable_metrics:
        from airserve.srt.metrics import ServerMetrics

        metrics = ServerMetrics(model_names(args, manager.info["model_path"])[0],
                                manager.replica_stats)
        manager.metrics = metrics
    app = create_app(manager, args, metrics, await devices)
    loop = asyncio.get_running_loop()
    verbose = args.log_level == "debug"
    config = uvicorn.Config(app, log_config=None, access_log=verbose, lifespan="off",
                            timeout_graceful_shutdown=5,
                            log_level=args.log_level if verbose else "warning")
    server = _UvicornServer(config, lambda: loop.call_soon_threadsafe(manager.begin_shutdown))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    code = 0
    if server.started and not server.should_exit:
        if await _warmup(manager, args):
            manager.ready = True
            host, port = sock.getsockname()[:2]
            logger.info("airserve is ready: http://%s:%d (model %s, device %s, decode runner %s"
                        "%s)", host, port, model_names(args, manager.info["model_path"])[0],
                        args.device, manager.info["runner"],
                        f", {args.dp_size} data-parallel replicas" if args.dp_size > 1 else "")
        else:
            code = 1
            server.should_exit = True
    await serving
    logger.info("server stopped")
    return code


def _discover_devices() -> dict:
    try:  # in a child: this process then never imports torch or OpenVINO
        return discover_in_child()
    except Exception as e:  # a diagnostic: /get_server_info reports it, the server still starts
        logger.warning("device discovery failed: %s: %s", type(e).__name__, e)
        return {"error": f"{type(e).__name__}: {e}"}


async def _warmup(manager: TokenizerManager, args: ServerArgs) -> bool:
    if args.skip_server_warmup:
        return True
    ids = manager.tokenizer.encode("The capital of France is")[:16] or [0]
    params = {"max_new_tokens": 8, "temperature": 0.0}
    try:  # every replica: each compiles its own graphs
        await asyncio.wait_for(asyncio.gather(*(_drain(manager.generate(ids, params, dp_rank=rank))
                                                for rank in range(args.dp_size))),
                               WARMUP_TIMEOUT_S)
    except (RequestError, TimeoutError) as e:
        logger.error("warm-up generation failed: %s; the server stops", e or "timed out")
        return False
    return True


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror}; pass a free --port "
                         "(or stop the process using it)") from None
    return sock


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
