"""OpenAI-compatible HTTP server over the reference engine (aiohttp).

`create_app(engine_loop)` builds the application around a started-on-startup `EngineLoop`;
`serve(config)` runs it until interrupted. Endpoints: POST /v1/completions,
POST /v1/chat/completions (streaming SSE or not), GET /v1/models, GET /health, GET /metrics.
A client that disconnects has its request aborted in the engine (the handler is cancelled, or
its next write fails). A full waiting queue answers 429 with Retry-After.

Run: `python -m engine_ref.serving.server --model tiny-random --port 0`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from engine_ref.core.engine_config import EngineConfig, EngineConfigError
from engine_ref.core.scheduler import QueueFullError
from engine_ref.serving.engine_loop import (
    ENGINE_LOOP_MODES,
    EngineLoop,
    EngineLoopError,
    ProcessEngineLoop,
    ThreadEngineLoop,
)
from engine_ref.serving.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from engine_ref.serving.protocol import (
    ApiError,
    ChoiceAccumulator,
    GenerationRequest,
    TokenLogprob,
    chunk_body,
    decode_json_body,
    error_body,
    parse_chat_request,
    parse_completion_request,
    response_body,
    usage_body,
)

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
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
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


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion_request)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat_request)


async def _generate(
    request: web.Request, parse: Callable[..., GenerationRequest]
) -> web.StreamResponse:
    state: _State = request.app[_STATE]
    try:
        body = decode_json_body(await request.read())
        info = state.engine_loop.info
        gen = parse(
            body,
            tokenizer=info.tokenizer,
            served_model=state.served_model_name,
            max_model_len=info.max_model_len,
        )
    except ApiError as exc:
        return _error_response(exc)
    prefix = "cmpl-" if gen.kind == "completion" else "chatcmpl-"
    run = _Run(state, gen, prefix + uuid.uuid4().hex)
    try:
        await run.submit()
    except ApiError as exc:
        return _error_response(exc)
    try:
        if gen.stream:
            return await run.stream(request)
        return await run.collect()
    finally:
        run.abort_unfinished()


class _Run:
    """One HTTP generation request: its engine requests (one per prompt) and their outputs."""

    def __init__(self, state: _State, gen: GenerationRequest, response_id: str) -> None:
        self.state = state
        self.gen = gen
        self.response_id = response_id
        self.created_s = int(time.time())
        self.sink: asyncio.Queue = asyncio.Queue()
        self.engine_ids = [f"{response_id}-{i}" for i in range(len(gen.prompts))]
        self.prompt_index = {rid: i for i, rid in enumerate(self.engine_ids)}
        self.timers: dict[str, RequestTimer] = {}
        self.unfinished: set[str] = set()
        self.prompt_tokens = 0
        self.choices = [ChoiceAccumulator(i) for i in range(gen.num_choices)]

    async def submit(self) -> None:
        """Add every engine request; ApiError 429/400/500 (nothing left running) on refusal."""
        loop = self.state.engine_loop
        for rid, prompt in zip(self.engine_ids, self.gen.prompts, strict=True):
            timer = self.state.metrics.tracker()
            try:
                await loop.add_request(
                    rid, prompt, self.gen.params, self.sink, priority=self.gen.priority
                )
            except QueueFullError:
                self.abort_unfinished(count=False)
                self.state.metrics.request_rejected()
                seconds = self.state.retry_after_s
                raise ApiError(
                    429,
                    "The server is at capacity (waiting queue full); retry later.",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(seconds)},
                ) from None
            except (EngineConfigError, ValueError) as exc:
                self.abort_unfinished(count=False)
                raise ApiError(400, str(exc)) from None
            except EngineLoopError as exc:
                self.abort_unfinished(count=False)
                raise ApiError(500, str(exc), type="server_error") from None
            self.timers[rid] = timer
            self.unfinished.add(rid)

    def abort_unfinished(self, *, count: bool = True) -> None:
        for rid in self.unfinished:
            self.state.engine_loop.abort(rid)
            if count:
                self.timers[rid].finished("abort")
        self.unfinished.clear()

    async def next_changes(self) -> list[int]:
        """Wait for the next engine output, fold it into the choices, and return the indices
        of the choices it changed. Raises EngineLoopError when the engine failed."""
        item = await self.sink.get()
        if isinstance(item, BaseException):
            raise item
        rid = item.request_id
        base = self.prompt_index[rid] * self.gen.params.n
        changed = []
        num_new_tokens = 0
        for completion in item.outputs:
            choice = self.choices[base + completion.index]
            choice.add(
                completion.new_text,
                list(completion.new_token_ids),
                self._logprobs(completion),
                completion.finish_reason,
                completion.num_output_tokens,
            )
            num_new_tokens += len(completion.new_token_ids)
            changed.append(choice.index)
        self.timers[rid].tokens_out(num_new_tokens)
        if item.finished:
            self.prompt_tokens += item.num_prompt_tokens
            self.unfinished.discard(rid)
            reason = next(
                (
                    c.finish_reason
                    for c in self.choices[base : base + self.gen.params.n]
                    if c.finish_reason
                ),
                "stop",
            )
            self.timers[rid].finished(reason, num_prompt_tokens=item.num_prompt_tokens)
        return changed

    def _logprobs(self, completion: Any) -> list[TokenLogprob]:
        """The engine's per-token `{token_id: logprob}` maps (sampled token plus top-k
        alternatives) as decoded entries; the top list keeps the k most likely."""
        if completion.logprobs is None or self.gen.params.logprobs is None:
            return []
        decode = self.state.engine_loop.info.tokenizer.decode
        k = self.gen.params.logprobs
        entries = []
        for token_id, by_id in zip(completion.new_token_ids, completion.logprobs, strict=True):
            ranked = sorted(by_id.items(), key=lambda item: -item[1])[:k]
            entries.append(
                TokenLogprob(
                    token=decode([token_id], skip_special_tokens=False),
                    logprob=float(by_id[token_id]),
                    top=tuple(
                        (decode([t], skip_special_tokens=False), float(lp)) for t, lp in ranked
                    ),
                )
            )
        return entries

    def usage(self) -> dict[str, int]:
        completion_tokens = sum(c.num_output_tokens for c in self.choices)
        return usage_body(self.prompt_tokens, completion_tokens)

    async def collect(self) -> web.Response:
        while self.unfinished:
            try:
                await self.next_changes()
            except EngineLoopError as exc:
                self.abort_unfinished()
                return _error_response(ApiError(500, str(exc), type="server_error"))
        body = response_body(
            self.gen.kind,
            self.response_id,
            self.created_s,
            self.gen.model,
            self.choices,
            self.usage(),
            with_logprobs=self.gen.wants_logprobs,
            with_token_ids=self.gen.return_token_ids,
        )
        return _json(body)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        write = _sse_writer(response)
        try:
            if self.gen.kind == "chat":
                for choice in self.choices:
                    await write(self._chunk(choice, role=True))
            while self.unfinished:
                try:
                    changed = await self.next_changes()
                except EngineLoopError as exc:
                    self.abort_unfinished()
                    await write(error_body(str(exc), type="server_error"))
                    break
                for index in changed:
                    choice = self.choices[index]
                    if choice.has_pending():
                        await write(self._chunk(choice))
            if self.gen.include_usage:
                await write(self._usage_chunk())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            LOG.debug("client of %s went away", self.response_id)
        return response

    def _chunk(self, choice: ChoiceAccumulator, *, role: bool = False) -> dict[str, Any]:
        body = chunk_body(
            self.gen.kind,
            self.response_id,
            self.created_s,
            self.gen.model,
            choice,
            role=role,
            with_logprobs=self.gen.wants_logprobs,
            with_token_ids=self.gen.return_token_ids,
        )
        if self.gen.include_usage:
            body["usage"] = None
        return body

    def _usage_chunk(self) -> dict[str, Any]:
        obj = "text_completion" if self.gen.kind == "completion" else "chat.completion.chunk"
        return {
            "id": self.response_id,
            "object": obj,
            "created": self.created_s,
            "model": self.gen.model,
            "choices": [],
            "usage": self.usage(),
        }


def _sse_writer(response: web.StreamResponse) -> Callable[[dict[str, Any]], Awaitable[None]]:
    async def write(body: dict[str, Any]) -> None:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        await response.write(b"data: " + data.encode("utf-8") + b"\n\n")

    return write


def build_engine_loop(config: ServerConfig) -> EngineLoop:
    """The engine loop of the configured mode. Either way the engine is built when the app
    starts, before the server binds, so model errors surface first; in thread mode it is
    built on the engine thread itself (see `ThreadEngineLoop`)."""
    if config.engine_loop == "process":
        return ProcessEngineLoop(config.engine)

    def build() -> Any:
        from engine_ref import EngineError, LLMEngine

        try:
            return LLMEngine(config.engine)
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


@contextlib.contextmanager
def running_server(
    config: ServerConfig, *, engine_loop: EngineLoop | None = None, startup_timeout_s: float = 120.0
) -> Iterator[str]:
    """Run the server on a background thread with its own event loop; yields the base URL
    (use port 0 for a free port) and stops the server, engine included, on exit."""
    started = threading.Event()
    urls: list[str] = []
    errors: list[BaseException] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def on_listening(url: str) -> None:
        urls.append(url)
        started.set()

    def run() -> None:
        try:
            loop.run_until_complete(
                serve(config, on_listening=on_listening, stop=stop, engine_loop=engine_loop)
            )
        except BaseException as exc:
            errors.append(exc)
        finally:
            started.set()
            loop.close()

    thread = threading.Thread(target=run, name="engine-ref-server", daemon=True)
    thread.start()
    try:
        if not started.wait(startup_timeout_s):
            raise ServerError(f"The server did not start within {startup_timeout_s:.0f} s.")
        if errors:
            raise errors[0]
        yield urls[0]
    finally:
        if thread.is_alive():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
            thread.join(60.0)


def main(argv: list[str] | None = None) -> None:
    """`python -m engine_ref.serving.server ...`: the `serve` command run standalone."""
    from engine_ref.serving.cli_serve import serve as serve_command

    serve_command.main(args=argv, prog_name="python -m engine_ref.serving.server")


if __name__ == "__main__":
    main()
