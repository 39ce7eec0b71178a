"""OpenAI-compatible HTTP server over the reference engine (aiohttp).

`create_app(engine_loop, config)` builds the application around a started-on-startup
`EngineLoop`; `serve(config)` runs it until interrupted. Endpoints: POST /v1/completions,
POST /v1/chat/completions, POST /v1/responses (OpenAI's Responses API) and POST /v1/messages
(Anthropic's Messages API; `events_api`), each streamed (SSE) or not, POST /v1/embeddings
and POST /v1/rerank (pooled last hidden states; `embeddings`), GET /v1/models,
GET /health, GET /metrics, GET /info. Every error answer carries an error body in its API's
shape (OpenAI's, or Anthropic's for /v1/messages).

What a client can cost is bounded (limits in `ServerConfig`): the body's size (413), the
prompt's characters and tokens (400), the time to send a request head (`connection.py`), and
how far a stream may fall behind a client that stopped reading (`slow_readers.py`). Bodies are
decoded, validated and tokenized in a worker thread, so a long prompt never holds up the event
loop. A request's engine requests (one per prompt) are admitted all or none, and a client that
disconnects has all of them aborted in the engine (its handler is cancelled, or its next write
fails), whether admission had finished or not. A request the engine refuses for overload (a
full waiting queue, a deadline it cannot meet) is answered 429 with the reason and
Retry-After.

Run: `python -m engine_ref.serving --model tiny-random --port 0` (see `__main__.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from engine_ref.serving.connection import listen
from engine_ref.serving.embeddings import DENSE_PATHS, dense_handler
from engine_ref.serving.endpoints import ENDPOINTS, Endpoint
from engine_ref.serving.engine_loop import EngineLoop
from engine_ref.serving.engine_process import ProcessEngineLoop
from engine_ref.serving.engine_thread import ThreadEngineLoop
from engine_ref.serving.errors import ApiError, error_body
from engine_ref.serving.events_api import EVENT_ENDPOINTS
from engine_ref.serving.generation import GenerationRun
from engine_ref.serving.interface import EngineError, EngineInterface, build_engine
from engine_ref.serving.metrics import CONTENT_TYPE, ServerMetrics
from engine_ref.serving.middlewares import api_key_guard, json_errors, json_response
from engine_ref.serving.reasoning import with_reasoning
from engine_ref.serving.requests import (
    DEADLINE_HEADER,
    GenerationRequest,
    deadline_header,
    decode_json_body,
)
from engine_ref.serving.server_config import ServerConfig, ServerError
from engine_ref.serving.slow_readers import StallSweeper

__all__ = ["ServerConfig", "ServerError", "build_engine_loop", "create_app", "serve"]

LOG = logging.getLogger("engine_ref.serving.server")
_STATE = web.AppKey("engine_ref_server_state", object)
# Threads that decode, validate and tokenize request bodies (tokenizing releases the GIL).
_PARSE_WORKERS = 4


@dataclass
class _State:
    engine_loop: EngineLoop
    config: ServerConfig
    served_model_name: str | None
    stalls: StallSweeper
    parser: concurrent.futures.ThreadPoolExecutor
    metrics: ServerMetrics | None = None
    created_s: int = field(default_factory=lambda: int(time.time()))
    run_factory: RunFactory | None = None


# Builds a generation request's run from its raw body and `GenerationRun`'s arguments (a P/D
# worker's: `engine_ref.cluster.pd_worker`); None keeps `GenerationRun`.
RunFactory = Callable[..., GenerationRun]


def create_app(
    engine_loop: EngineLoop, config: ServerConfig, *, run_factory: RunFactory | None = None
) -> web.Application:
    """The aiohttp application; it starts `engine_loop` on startup and closes it on cleanup.
    `config.served_model_name` None means the engine's model name. `run_factory(endpoint,
    gen, raw_body, **kwargs)` replaces `GenerationRun(endpoint, gen, **kwargs)`."""
    middlewares = [json_errors]
    if config.api_key is not None:
        middlewares.append(api_key_guard(config.api_key))
    # The body bound applies while reading too; `_generate` checks Content-Length first.
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    parser = concurrent.futures.ThreadPoolExecutor(_PARSE_WORKERS, thread_name_prefix="parse")
    stalls = StallSweeper(config.stream_write_timeout_s)
    app[_STATE] = _State(
        engine_loop, config, config.served_model_name, stalls, parser, run_factory=run_factory
    )
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    for endpoint in (*ENDPOINTS.values(), *EVENT_ENDPOINTS):
        endpoint = with_reasoning(endpoint, config.reasoning_parser)
        app.router.add_post(endpoint.path, _generate_handler(endpoint))
    for rerank, path in DENSE_PATHS.items():  # /v1/embeddings, /v1/rerank (embeddings.py)
        app.router.add_post(path, dense_handler(rerank, lambda request: request.app[_STATE]))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/info", _info)
    app.router.add_get("/metrics", _metrics)
    if config.enable_fault_injection:
        app.router.add_post("/admin/step_delay", _step_delay)
    return app


async def _on_startup(app: web.Application) -> None:
    state: _State = app[_STATE]
    await state.engine_loop.start()
    info = state.engine_loop.info
    if state.served_model_name is None:
        state.served_model_name = info.model_name
    state.metrics = ServerMetrics(state.served_model_name, lambda: state.engine_loop.latest_stats)


async def _on_cleanup(app: web.Application) -> None:
    state: _State = app[_STATE]
    await state.stalls.close()
    state.parser.shutdown(wait=False, cancel_futures=True)
    await state.engine_loop.close()


def _error_response(error: ApiError, endpoint: Endpoint | None = None) -> web.Response:
    body = error.body() if endpoint is None else endpoint.error_body(error)
    return json_response(body, status=error.status, headers=error.headers)


async def _health(request: web.Request) -> web.Response:
    state: _State = request.app[_STATE]
    dead = state.engine_loop.failure
    if dead is not None:
        return json_response(error_body(dead, type="server_error"), status=503)
    return web.Response(text="ok")


async def _info(request: web.Request) -> web.Response:
    """Engine name, version, model, dtype, device and engine config, for benchmark manifests."""
    state: _State = request.app[_STATE]
    return json_response(
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
    return json_response({"object": "list", "data": [model]})


MAX_STEP_DELAY_MS = 60_000


async def _step_delay(request: web.Request) -> web.Response:
    """Fault injection (only with `enable_fault_injection`): `{"delay_ms": N}` makes every
    engine step N ms slower until set back to 0; answers the delay now in force."""
    state: _State = request.app[_STATE]
    try:
        body = decode_json_body(await request.read())
        delay_ms = body.get("delay_ms")
        if set(body) != {"delay_ms"}:
            raise ApiError(400, 'The body must be {"delay_ms": N} and nothing else.')
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, int | float):
            raise ApiError(400, "delay_ms must be a number of milliseconds.")
        if not 0 <= delay_ms <= MAX_STEP_DELAY_MS:
            raise ApiError(400, f"delay_ms must be within 0..{MAX_STEP_DELAY_MS}, got {delay_ms}.")
    except ApiError as error:
        return _error_response(error)
    state.engine_loop.set_step_delay(delay_ms / 1e3)
    return json_response({"delay_ms": delay_ms})


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
        deadline_ms = deadline_header(request.headers.get(DEADLINE_HEADER))
        raw = await _read_body(request, state.config.max_body_bytes)
        gen = await asyncio.get_running_loop().run_in_executor(
            state.parser, _parse, endpoint, raw, state
        )
        gen = dataclasses.replace(gen, deadline_ms=deadline_ms)
    except ApiError as exc:
        return _error_response(exc, endpoint)
    factory = state.run_factory
    run = (GenerationRun if factory is None else functools.partial(factory, raw_body=raw))(
        endpoint,
        gen,
        response_id=endpoint.id_prefix + uuid.uuid4().hex,
        engine_loop=state.engine_loop,
        metrics=state.metrics,
        retry_after_s=state.config.retry_after_s,
        max_backlog=state.config.max_stream_backlog,
        with_prompt_details=state.config.enable_prompt_tokens_details,
    )
    run.on_abandon = lambda: _close_connection(request)
    try:
        await run.submit()
        if gen.stream:
            return await _stream(request, run, state.stalls)
        return json_response(await run.collect())
    except ApiError as exc:
        return _error_response(exc, endpoint)
    finally:
        run.abort_unfinished()


async def _read_body(request: web.Request, max_body_bytes: int) -> bytes:
    """The body, or ApiError 413 when its Content-Length or what arrives exceeds the bound."""
    declared = request.content_length
    if declared is None or declared <= max_body_bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            pass
    raise ApiError(
        413,
        f"The request body exceeds this server's limit of {max_body_bytes} bytes "
        "(--max-body-bytes).",
        code="request_too_large",
    )


def _parse(endpoint: Endpoint, raw: bytes, state: _State) -> GenerationRequest:
    """Runs in a worker thread: decode, validate and tokenize one body."""
    info = state.engine_loop.info
    return endpoint.parse(
        decode_json_body(raw),
        tokenizer=info.tokenizer,
        served_model=state.served_model_name,
        max_model_len=info.max_model_len,
        max_prompt_chars=state.config.max_prompt_chars,
    )


def _close_connection(request: web.Request) -> None:
    """Drop a connection whose client stopped reading, without flushing what it did not
    read; aiohttp then cancels its handler."""
    transport = request.transport
    if transport is not None:
        transport.abort()


async def _stream(
    request: web.Request, run: GenerationRun, stalls: StallSweeper
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    watch = stalls.watch(run.abandon)
    try:
        async with (
            contextlib.aclosing(run.stream_bodies()) as bodies,
            contextlib.aclosing(run.endpoint.sse_frames(bodies)) as frames,
        ):
            async for data in frames:
                watch.writes_started += 1
                await response.write(data)
                watch.writes_done += 1
        watch.writes_started += 1
        await response.write_eof()
        watch.writes_done += 1
    except ConnectionResetError:
        LOG.debug("client of %s went away", run.response_id)
    finally:
        stalls.unwatch(watch)
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
    run_factory: RunFactory | None = None,
) -> None:
    """Serve until `stop` is set (or forever). `on_listening` gets the base URL once bound.
    `engine_loop` overrides the one `config` describes (tests pass one around a fake engine);
    `run_factory` as in `create_app`."""
    if engine_loop is None:
        engine_loop = build_engine_loop(config)
    app = create_app(engine_loop, config, run_factory=run_factory)
    await serve_app(app, config, on_listening, stop, f"serving {app[_STATE].served_model_name}")


async def serve_app(
    app: web.Application,
    config: ServerConfig,
    on_listening: Callable[[str], None] | None,
    stop: asyncio.Event | None,
    what: str,
) -> None:
    """Listen on `config`'s host and port with `app` (a server's or a router's) until `stop`
    is set (or forever): the bound port goes to `config.port_file` and `on_listening`, and
    the log says `what` at which URL."""
    # Requests still streaming at shutdown get 2 s, then are cancelled (and aborted), so a
    # SIGTERM stops the server well within a launcher's grace period.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    listener: asyncio.AbstractServer | None = None
    try:
        try:
            listener = await listen(
                runner.server, config.host, config.port, header_timeout_s=config.header_timeout_s
            )
        except OSError as exc:
            raise ServerError(
                f"Cannot listen on {config.host}:{config.port}: {exc.strerror}."
            ) from None
        port = listener.sockets[0].getsockname()[1]
        url = f"http://{config.host}:{port}"
        if config.port_file is not None:
            config.port_file.write_text(f"{port}\n")
        LOG.info("%s at %s", what, url)
        if on_listening is not None:
            on_listening(url)
        await (stop or asyncio.Event()).wait()
    finally:
        if listener is not None:
            listener.close()
        await runner.cleanup()
