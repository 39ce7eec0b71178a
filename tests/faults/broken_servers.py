"""Servers for the bad-input probe's tests: a small OpenAI-like aiohttp app that validates its
input properly (its "model" answers with the prompt reversed), and the same app broken on
purpose. `serving(app)` runs one in a background thread, so a probe in the test's own thread
(through `asyncio.run` or click's CliRunner) can reach it over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import queue
import threading
import warnings
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

from aiohttp import web

MODEL = "probe-test-model"
VOCAB_SIZE = 1000
_CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class Fault(StrEnum):
    NONE = "none"
    ERROR_500_ON_WRONG_TYPE = "500-on-wrong-type"  # a mistyped field answers 500, not 400
    HANG_ON_OBJECT_FIELD = "hang-on-object-field"  # a `probe_unknown` object: never answers
    CRASH_ON_LIST_MAX_TOKENS = "crash-on-list-max-tokens"  # max_tokens [8]: stops serving


_FAULT = web.AppKey("fault", Fault)
_CRASHED = web.AppKey("crashed", asyncio.Event)


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class WrongType(BadRequest):
    pass


def create_app(fault: Fault = Fault.NONE, *, has_health: bool = True) -> web.Application:
    app = web.Application(client_max_size=1024 * 1024, middlewares=[_errors_as_json])
    app[_FAULT] = fault
    app[_CRASHED] = asyncio.Event()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    if has_health:
        app.router.add_get("/health", _health)
    return app


@contextlib.contextmanager
def serving(app: web.Application) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 from a thread; yields its base URL. A crashed app stops
    listening (connections are refused) until the block ends."""
    ready: queue.Queue = queue.Queue()
    thread = threading.Thread(target=lambda: asyncio.run(_serve(app, ready)), daemon=True)
    thread.start()
    port, loop, stop = ready.get(timeout=10)
    try:
        # A crashed app abandons the connection it aborted; should the collector find that
        # socket while the block runs (it did once, under load), its ResourceWarning is this
        # deliberately broken server's, not the code under test's.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
        # Whatever of this deliberately broken server's sockets is still unclosed is collected
        # here and its ResourceWarning dropped; left to the collector, it fails a later test.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


async def _serve(app: web.Application, ready: queue.Queue) -> None:
    stop = asyncio.Event()
    runner = web.AppRunner(app, shutdown_timeout=0.2, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    ready.put((runner.addresses[0][1], asyncio.get_running_loop(), stop))
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(app[_CRASHED].wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    # aiohttp answers a request whose headers it cannot parse with a 400 but can leave that
    # connection's transport open through cleanup; closed here, it cannot surface later as a
    # ResourceWarning in whichever test the garbage collector happens to run in.
    transports = list(runner.server._connections.values()) if runner.server else []
    await runner.cleanup()
    for transport in transports:
        if not transport.is_closing():
            transport.close()
    await asyncio.sleep(0)
    await stop.wait()
    for task in waits:
        task.cancel()


@web.middleware
async def _errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.reason, exc.status)
    except WrongType as exc:
        if request.app[_FAULT] is Fault.ERROR_500_ON_WRONG_TYPE:
            return _error(f"TypeError: {exc}", 500)
        return _error(str(exc), exc.status)
    except BadRequest as exc:
        return _error(str(exc), exc.status)


def _error(message: str, status: int) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request"}}, status=status
    )


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = prompt
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        if not all(0 <= t < VOCAB_SIZE for t in prompt):
            raise BadRequest(f"prompt token ids must be in [0, {VOCAB_SIZE}).")
        texts = [" ".join(map(str, prompt))]
    elif prompt is None:
        raise BadRequest("prompt is required.")
    else:
        raise WrongType("prompt must be a string, a list of strings or a list of token ids.")
    if not all(texts):
        raise BadRequest("prompt must not be empty.")
    max_tokens = _int(body, "max_tokens", 1, 4096, default=16)
    _common(body, max_tokens)
    _int(body, "logprobs", 0, 5)
    return await _answer(request, body, texts[0], max_tokens, chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("messages is required.")
    if not isinstance(messages, list):
        raise WrongType("messages must be a list.")
    if not messages:
        raise BadRequest("messages must not be empty.")
    contents = [_content(i, m) for i, m in enumerate(messages)]
    max_tokens = _int(body, "max_completion_tokens", 1, 4096)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, 4096, default=16)
    _common(body, max_tokens)
    if _bool(body, "logprobs"):
        _int(body, "top_logprobs", 0, 20)
    elif body.get("top_logprobs") is not None:
        raise BadRequest("top_logprobs needs logprobs.")
    return await _answer(request, body, contents[-1], max_tokens, chat=True)


def _content(i: int, message: Any) -> str:
    if not isinstance(message, dict):
        raise WrongType(f"messages[{i}] must be an object.")
    if message.get("role") not in _CHAT_ROLES:
        raise WrongType(f"messages[{i}].role must be one of {sorted(_CHAT_ROLES)}.")
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise WrongType(f"messages[{i}].content must be a string or a list of text parts.")


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"The body is not UTF-8 JSON: {type(exc).__name__}.") from None
    if not isinstance(body, dict):
        raise BadRequest("The body must be a JSON object.")
    if _has_surrogate(body):
        raise BadRequest("The body holds a lone surrogate.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise WrongType("model must be a string.")
    if model is not None and model != MODEL:
        raise BadRequest(f"The model {model!r} does not exist.", status=404)
    if request.app[_FAULT] is Fault.HANG_ON_OBJECT_FIELD and isinstance(
        body.get("probe_unknown"), dict
    ):
        await asyncio.Event().wait()
    if request.app[_FAULT] is Fault.CRASH_ON_LIST_MAX_TOKENS and isinstance(
        body.get("max_tokens"), list
    ):
        request.app[_CRASHED].set()
        assert request.transport is not None
        request.transport.abort()
        await asyncio.Event().wait()
    return body


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _has_surrogate(body: dict[str, Any]) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _common(body: dict[str, Any], max_tokens: int) -> None:
    _int(body, "n", 1, 8)
    _int(body, "top_k", -1, 10**6)
    _int(body, "seed", -(2**63), 2**63 - 1)
    _int(body, "min_tokens", 0, max_tokens)
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 1e-9, 1.0)
    _number(body, "presence_penalty", -2.0, 2.0)
    _number(body, "frequency_penalty", -2.0, 2.0)
    _bool(body, "stream")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise WrongType("stop must be a string or a list of strings.")
    if stop is not None and (len(stop) > 4 or not all(stop)):
        raise BadRequest("stop takes at most 4 non-empty strings.")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str, low: int, high: int, default: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not _is_token(value):
        raise WrongType(f"{name} must be an integer.")
    if not low <= value <= high:
        raise BadRequest(f"{name} must be in [{low}, {high}].")
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WrongType(f"{name} must be a number.")
    if not (math.isfinite(value) and low <= value <= high):
        raise BadRequest(f"{name} must be in [{low}, {high}].")


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise WrongType(f"{name} must be true or false.")
    return bool(value)


def completion_text(prompt: str, max_tokens: int) -> str:
    """The test model's answer: the prompt reversed, one character per token."""
    return prompt[::-1][:max_tokens]


async def _answer(
    request: web.Request, body: dict[str, Any], prompt: str, max_tokens: int, *, chat: bool
) -> web.StreamResponse:
    text = completion_text(prompt, max_tokens)
    if not body.get("stream"):
        choice = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response({"id": "probe-test", "model": MODEL, "choices": [choice]})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for char in text:
        delta = {"delta": {"content": char}} if chat else {"text": char}
        event = {"id": "probe-test", "choices": [{"index": 0, **delta, "finish_reason": None}]}
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
