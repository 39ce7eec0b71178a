"""OpenAI-compatible HTTP server over the reference engine (aiohttp).

`create_app(engine_loop)` builds the application around a started-on-startup `EngineLoop`;
`serve(config)` runs it until interrupted. Endpoints: POST /v1/completions,
POST /v1/chat/completions (streaming SSE or not), GET /v1/models, GET /health, GET /metrics.
A client that disconnects has its request aborted in the engine (the handler is cancelled, or
its next write fails). A full waiting queue answers 429 with Retry-After.

Run: `python -m engine_ref.serving --model tiny-random --port 0` (see `__main__.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from engine_ref.serving.endpoints import ENDPOINTS, Endpoint
from engine_ref.serving.engine_loop import ENGINE_LOOP_MODES, EngineLoop
from engine_ref.serving.engine_process import ProcessEngineLoop
from engine_ref.serving.engine_thread import ThreadEngineLoop
from engine_ref.serving.errors import ApiError, error_body
from engine_ref.serving.generation import GenerationRun
from engine_ref.serving.interface import EngineConfig, EngineError, EngineInterface, build_engine
from engine_ref.serving.metrics import CONTENT_TYPE, ServerMetrics
from engine_ref.serving.requests import decode_json_body
from engine_ref.serving.responses import SSE_DONE, sse_event

LOG = logging.getLogger("engine_ref.serving.server")
_STATE = web.AppKey("engine_ref_server_state", object)


class ServerError(Exception):
    """The server cannot start as configured; the message is one sentence naming the fix."""


@dataclass(frozen=True)
class ServerConfig:
    """How to serve: the engine's own config plus the HTTP side. `port` 0 picks a free port.
    `retry_after_s` is the Retry-After header (seconds) sent with 429 answers."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    port_file: Path | None = None
    engine_loop: str = "thread"
    served_model_name: str | None = None
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.engine_loop not in ENGINE_LOOP_MODES:
            raise ServerError(
                f"Unknown engine loop {self.engine_loop!r}; use one of {', '.join(ENGINE_LOOP_MODES)}."
            )
        if not 0 <= self.port <= 65535:
            raise ServerError(f"Port {self.port} is outside 0..65535.")
        if self.retry_after_s < 0:
            raise ServerError("retry_after_s must be non-negative.")


@dataclass
class _State:
    engine_loop: EngineLoop
    served_model_name: str | None
    retry_after_s: int
    metrics: ServerMetrics | None = None
    created_s: int = field(default_factory=lambda: int(time.time()))


def create_app(
    engine_loop: EngineLoop, *, served_model_name: str | None = None, retry_after_s: int = 1
) -> web.Application:
    """The aiohttp application; it starts `engine_loop` on startup and closes it on cleanup.
    `served_model_name` None means the engine's model name."""
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_json_errors])
    app[_STATE] = _State(engine_loop, served_model_name, retry_after_s)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    for endpoint in ENDPOINTS.values():
        app.router.add_post(endpoint.path, _generate_handler(endpoint))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/info", _info)
    app.router.add_get("/metrics", _metrics)
    return app


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error answer carries an OpenAI error body: aiohttp's own (unknown path, wrong
    method, body too large) and any unexpected exception (500; the server keeps serving)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        message = f"{exc.reason} ({request.method} {request.path})."
        return _json(error_body(message, type=kind), status=exc.status)
    except Exception as exc:
        LOG.exception("unexpected error serving %s %s", request.method, request.path)
        message = f"Internal server error: {type(exc).__name__}: {exc}."
        return _json(error_body(message, type="server_error"), status=500)


async def _on_startup(app: web.Application) -> None:
    state: _State = app[_STATE]
    await state.engine_loop.start()
    info = state.engine_loop.info
    if state.served_model_name is None:
        state.served_model_name = info.model_name
    state.metrics = ServerMetrics(state.served_model_name, lambda: state.engine_loop.latest_stats)


async def _on_cleanup(app: web.Application) -> None:
    await app[_STATE].engine_loop.close()


def _json(
    body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=json.dumps(body, ensure_ascii=False).encode("utf-8"),
        status=status,
        headers=headers,
        content_type="application/json",
    )


def _error_response(error: ApiError) -> web.Response:
    return _json(error.body(), status=error.status, headers=error.headers)


async def _health(request: web.Request) -> web.Response:
    state: _State = request.app[_STATE]
    dead = state.engine_loop.failure
    if dead is not None:
        return _json(error_body(dead, type="server_error"), status=503)
    return web.Response(text="ok")


async def _info(request: web.Request) -> web.Response:
    """Engine name, version, model, dtype, device and engine config, for benchmark manifests."""
    state: _State = request.app[_STATE]
    return _json(
        {**state.engine_loop.info.description, "served_model_name": state.served_model_name}
    )


async def _models(request: web.Request) -> web.Response:
    state: _State = request.app[_STATE]
    model = {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created_s,
        "owned_by": "engine_ref",
        "max_model_len": state.engine_loop.info.max_model_len,
    }
    return _json({"object": "list", "data": [model]})


async def _metrics(request: web.Request) -> web.Response:
    state: _State = request.app[_STATE]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def _generate_handler(endpoint: Endpoint) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _generate(request, endpoint)

    return handle


async def _generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state: _State = request.app[_STATE]
    try:
        body = decode_json_body(await request.read())
        info = state.engine_loop.info
        gen = endpoint.parse(
            body,
            tokenizer=info.tokenizer,
            served_model=state.served_model_name,
            max_model_len=info.max_model_len,
        )
    except ApiError as exc:
        return _error_response(exc)
    run = GenerationRun(
        endpoint,
        gen,
        response_id=endpoint.id_prefix + uuid.uuid4().hex,
        engine_loop=state.engine_loop,
        metrics=state.metrics,
        retry_after_s=state.retry_after_s,
    )
    try:
        await run.submit()
    except ApiError as exc:
        return _error_response(exc)
    try:
        if gen.stream:
            return await _stream(request, run)
        try:
            return _json(await run.collect())
        except ApiError as exc:
            return _error_response(exc)
    finally:
        run.abort_unfinished()


async def _stream(request: web.Request, run: GenerationRun) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        async with contextlib.aclosing(run.stream_bodies()) as bodies:
            async for body in bodies:
                await response.write(sse_event(body))
        await response.write(SSE_DONE)
        await response.write_eof()
    except ConnectionResetError:
        LOG.debug("client of %s went away", run.response_id)
    return response


def build_engine_loop(config: ServerConfig) -> EngineLoop:
    """The engine loop of the configured mode. Either way the engine is built when the app
    starts, before the server binds, so model errors surface first; in thread mode it is
    built on the engine thread itself (see `ThreadEngineLoop`)."""
    if config.engine_loop == "process":
        return ProcessEngineLoop(config.engine)

    def build() -> EngineInterface:
        try:
            return build_engine(config.engine)
        except EngineError as exc:  # e.g. a KV cache too small for two blocks
            raise ServerError(str(exc)) from None

    return ThreadEngineLoop(build=build)


async def serve(
    config: ServerConfig,
    *,
    on_listening: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    engine_loop: EngineLoop | None = None,
) -> None:
    """Serve until `stop` is set (or forever). `on_listening` gets the base URL once bound.
    `engine_loop` overrides the one `config` describes (tests pass one around a fake engine)."""
    if engine_loop is None:
        engine_loop = build_engine_loop(config)
    app = create_app(
        engine_loop, served_model_name=config.served_model_name, retry_after_s=config.retry_after_s
    )
    # Requests still streaming at shutdown get 2 s, then are cancelled (and aborted), so a
    # SIGTERM stops the server well within a launcher's grace period.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        try:
            await site.start()
        except OSError as exc:
            raise ServerError(
                f"Cannot listen on {config.host}:{config.port}: {exc.strerror}."
            ) from None
        port = runner.addresses[0][1]
        url = f"http://{config.host}:{port}"
        if config.port_file is not None:
            config.port_file.write_text(f"{port}\n")
        LOG.info("serving %s at %s", app[_STATE].served_model_name, url)
        if on_listening is not None:
            on_listening(url)
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
