"""A mock OpenAI-compatible engine: configurable latency, output lengths, failures and capacity.

It is the fixture for the harness's own tests. Latency is scheduled against absolute times
(first token at `ttft`, token i at `ttft + i * itl` after service starts), so timing error does
not accumulate. With `max_concurrency`, requests queue for a slot: the server then saturates at
`max_concurrency / service_time` requests per second, like a real engine at capacity.

It also speaks OpenAI's Responses and Anthropic's Messages APIs (`mock_events`) and answers
embeddings and rerank (`mock_dense`).

`max_tokens` (and chat's `max_completion_tokens`, Responses' `max_output_tokens`) must be an integer from 1 to
`MAX_TOKENS_LIMIT` (1,048,576: the mock has no model and so no context length to bound it);
null or absent means 16. Anything else is a 400 with an OpenAI error body. A request whose
client leaves is dropped at once (aiohttp's handler cancellation): no token is scheduled or
written for it after that.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, fields

from aiohttp import web

from harness.http.client import DEADLINE_HEADER
from harness.targets.mock_dense import add_dense_routes
from harness.targets.mock_events import EVENT_PATHS, add_event_routes, respond_events
from harness.targets.mock_pace import TokenPace
from harness.targets.mock_tools import TOOL_CALL_MODES, tool_call
from harness.targets.mock_tools import delta as tool_delta
from harness.targets.mock_tools import message as tool_message
from harness.targets.mock_tools import pieces as tool_pieces

FAULT_KINDS = ("error", "reject", "reset", "incomplete", "malformed_sse", "malformed_json", "stall")
MAX_TOKENS_LIMIT = 1 << 20  # the most output tokens one request may ask for
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class MockConfig:
    """Behaviour of the mock server. Times in milliseconds, rates are per-request probabilities."""

    ttft_ms: float = 50.0
    itl_ms: float = 10.0
    jitter_sigma: float = 0.0  # lognormal sigma applied to TTFT and each ITL; 0 = exact
    output_len: int | None = None  # None: honour max_tokens
    max_concurrency: int | None = None  # slots; None = unlimited
    error_rate: float = 0.0  # HTTP 500
    reject_rate: float = 0.0  # HTTP 429 with Retry-After
    reset_rate: float = 0.0  # connection aborted mid-stream
    incomplete_rate: float = 0.0  # stream ends without [DONE]
    malformed_sse_rate: float = 0.0
    malformed_json_rate: float = 0.0
    stall_rate: float = 0.0  # stream pauses for stall_s mid-way
    stall_s: float = 5.0
    seed: int = 0
    model: str = "mock"
    usage: bool = True  # False: never report usage (as llama.cpp's server when streaming)
    api_key: str | None = None  # set: generation requests need `Authorization: Bearer <key>`
    metrics: bool = False  # serve /metrics with vLLM's running/waiting/KV gauges
    leak_on_cancel: bool = False  # a request whose client went away is never released (a bug
    # on purpose, so the ledger's leak check can be shown to catch one); implies metrics
    tool_calls: str | None = None  # answer chat requests with tools by a call (`mock_tools`)

    def __post_init__(self) -> None:
        if self.ttft_ms < 0 or self.itl_ms < 0:
            raise ValueError("ttft_ms and itl_ms must be >= 0")
        rates = [getattr(self, f"{k}_rate") for k in FAULT_KINDS]
        if any(r < 0 for r in rates) or sum(rates) > 1:
            raise ValueError("fault rates must be >= 0 and sum to at most 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if self.output_len is not None and self.output_len < 1:
            raise ValueError("output_len must be at least 1")
        if self.tool_calls is not None and self.tool_calls not in TOOL_CALL_MODES:
            raise ValueError(f"tool_calls must be one of {', '.join(TOOL_CALL_MODES)}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class MockEngine:
    """The request handlers, with their seeded random state (one instance per server)."""

    def __init__(self, config: MockConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        self.requests_seen = 0
        self.requests_by_path: dict[str, int] = {}
        self.running = 0  # requests being served (the /metrics gauges)
        self.kv_blocks_used = 0
        self.tokens_generated = 0  # output tokens sent (streamed events, or whole answers)
        self.streams_abandoned = 0  # requests whose client left before the answer ended
        # (user, priority, x-request-deadline-ms) as each request carried them: the request
        # classes a workload sends (`workloads.classes`), JSON keys for /stats
        self.classes_seen: dict[str, int] = {}

    def _draw_fault(self) -> str | None:
        u = self.rng.random()
        for kind in FAULT_KINDS:
            u -= getattr(self.config, f"{kind}_rate")
            if u < 0:
                return kind
        return None

    def _jitter(self) -> float:
        sigma = self.config.jitter_sigma
        return math.exp(self.rng.gauss(0.0, sigma)) if sigma > 0 else 1.0

    async def stats(self, _request: web.Request) -> web.Response:
        """What the mock has served (for tests): `{requests_seen, requests_by_path,
        tokens_generated, streams_abandoned, running, classes_seen}`: the output tokens it sent,
        the requests whose client left before their answer ended, the requests being served
        now, and how many requests carried each [user, priority, deadline header] triple."""
        return web.json_response(
            {
                "requests_seen": self.requests_seen,
                "requests_by_path": self.requests_by_path,
                "tokens_generated": self.tokens_generated,
                "streams_abandoned": self.streams_abandoned,
                "running": self.running,
                "classes_seen": self.classes_seen,
            }
        )

    def _authorised(self, request: web.Request) -> bool:
        key = self.config.api_key
        given = request.headers.get("x-api-key")  # Anthropic's clients send it so
        bearer = request.headers.get("Authorization")
        return key is None or bearer == f"Bearer {key}" or given == key

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return _error(401, "the mock needs its API key as a bearer token")
        return web.json_response(
            {"object": "list", "data": [{"id": self.config.model, "object": "model"}]}
        )

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def admit(self, request: web.Request) -> dict | web.Response:
        """Count the request, check its key and read its JSON object body; an error answer
        instead when the key or the body is wrong."""
        self.requests_seen += 1
        self.requests_by_path[request.path] = self.requests_by_path.get(request.path, 0) + 1
        if not self._authorised(request):
            return _error(401, "the mock needs its API key as a bearer token")
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        return body

    async def generate(self, request: web.Request) -> web.StreamResponse:
        start = (
            asyncio.get_running_loop().time()
        )  # service starts on arrival, before the body is read
        body = await self.admit(request)
        if isinstance(body, web.Response):
            return body
        requested = _max_tokens(body)
        if isinstance(requested, web.Response):
            return requested
        seen = (body.get("user"), body.get("priority"), request.headers.get(DEADLINE_HEADER))
        key = json.dumps(seen)
        self.classes_seen[key] = self.classes_seen.get(key, 0) + 1
        chat = request.path.endswith("/chat/completions")
        n_out = self.config.output_len or requested
        fault = self._draw_fault()
        if fault == "reject":
            return _error(429, "the mock's queue is full", headers={"Retry-After": "1"})
        if fault == "error":
            return _error(500, "the mock failed this request on purpose")
        if self.slots is None:
            return await self._serve(request, body, chat, n_out, fault, start)
        async with self.slots:
            start = max(start, asyncio.get_running_loop().time())  # queued: service starts now
            return await self._serve(request, body, chat, n_out, fault, start)

    async def _serve(self, request, body, chat, n_out, fault, start) -> web.StreamResponse:
        self.running += 1
        self.kv_blocks_used += 1
        released = True
        try:
            return await self._respond(request, body, chat, n_out, fault, start)
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            self.streams_abandoned += 1
            released = not self.config.leak_on_cancel
            raise
        finally:
            if released:
                self.running -= 1
                self.kv_blocks_used -= 1

    async def metrics_text(self, _request: web.Request) -> web.Response:
        """vLLM-named gauges, for the ledger's leak check."""
        lines = []
        for name, value in (
            ("num_requests_running", self.running),
            ("num_requests_waiting", 0),
            ("kv_cache_blocks_used", self.kv_blocks_used),
        ):
            lines += [
                f"# TYPE vllm:{name} gauge",
                f'vllm:{name}{{model_name="{self.config.model}"}} {value}',
            ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _respond(self, request, body, chat, n_out, fault, start) -> web.StreamResponse:
        if request.path in EVENT_PATHS:  # Responses, Messages: typed events
            return await respond_events(self, request, body, n_out, fault, start)
        cfg = self.config
        loop = asyncio.get_running_loop()
        ttft_s = cfg.ttft_ms / 1e3 * self._jitter()
        prompt = body.get("prompt") or " ".join(
            str(m.get("content", "")) for m in body.get("messages", [])
        )
        usage = {
            "prompt_tokens": len(str(prompt).split()),
            "completion_tokens": n_out,
            "total_tokens": 0,
        }
        usage["total_tokens"] = usage["prompt_tokens"] + n_out
        ids = {"x-request-id": f"mock-{self.requests_seen}"}  # as servers that echo one do
        call = tool_call(cfg.tool_calls, body, n_out) if chat else None  # (name, arguments)
        fragments = tool_pieces(call[1], n_out) if call is not None else None
        if not body.get("stream"):
            last_s = ttft_s + sum(cfg.itl_ms / 1e3 * self._jitter() for _ in range(n_out - 1))
            await asyncio.sleep(max(0.0, start + last_s - loop.time()))
            text = "".join(f" t{i}" for i in range(n_out))
            choice = {"index": 0, "finish_reason": "length"}
            choice.update(
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            if call is not None:
                choice.update(message=tool_message(*call), finish_reason="tool_calls")
            answer = {"id": "mock", "object": "completion", "choices": [choice]}
            self.tokens_generated += n_out
            if cfg.usage:
                answer["usage"] = usage
            return web.json_response(answer, headers=ids)

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **ids})
        await response.prepare(request)
        break_at = max(1, n_out // 2)
        created = int(time.time())
        if chat:
            await response.write(_event(_chunk(cfg.model, created, chat, None, role=True)))
        pace = TokenPace(self, request, response, start, ttft_s, fault, break_at)
        async for i in pace.tokens(n_out, bad_json=b"data: {not json\n\n"):
            reason = "length" if i == n_out - 1 else None
            chunk = _chunk(cfg.model, created, chat, f" t{i}", finish_reason=reason)
            if call is not None:
                chunk["choices"][0]["delta"] = tool_delta(i, call[0], fragments[i])
                chunk["choices"][0]["finish_reason"] = reason and "tool_calls"
            await response.write(_event(chunk))
            self.tokens_generated += 1
        if pace.cut:
            return response
        if cfg.usage and (body.get("stream_options") or {}).get("include_usage"):
            final = {
                "id": "mock",
                "object": "chunk",
                "created": created,
                "model": cfg.model,
                "choices": [],
                "usage": usage,
            }
            await response.write(_event(final))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _chunk(model, created, chat, text, *, finish_reason=None, role=False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason}
        kind = "text_completion"
    return {"id": "mock", "object": kind, "created": created, "model": model, "choices": [choice]}


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _max_tokens(body: dict) -> int | web.Response:
    """The output length `body` asks for (`max_tokens`, else `max_completion_tokens`, else
    the default), or the 400 for a value outside 1..MAX_TOKENS_LIMIT or not an integer."""
    requested = None
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            problem = f"must be an integer, got {value!r}"
        elif value < 1:
            problem = f"must be at least 1, got {value}"
        elif value > MAX_TOKENS_LIMIT:
            problem = f"must be at most {MAX_TOKENS_LIMIT}, got {value}"
        else:
            requested = value if requested is None else requested
            continue
        return _error(400, f"{name} {problem}.", param=name)
    return DEFAULT_MAX_TOKENS if requested is None else requested


def _error(
    status: int, message: str, headers: dict | None = None, *, param: str | None = None
) -> web.Response:
    kind = (
        "rate_limit_error"
        if status == 429
        else ("server_error" if status >= 500 else "invalid_request_error")
    )
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


ENGINE_KEY = web.AppKey("engine", MockEngine)


def make_app(config: MockConfig) -> web.Application:
    """The aiohttp application; the handlers' state lives in a `MockEngine` stored on the app."""
    engine = MockEngine(config)
    app = web.Application()
    app[ENGINE_KEY] = engine
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/health", engine.health)
    app.router.add_get("/stats", engine.stats)
    if config.metrics or config.leak_on_cancel:
        app.router.add_get("/metrics", engine.metrics_text)
    app.router.add_post("/v1/completions", engine.generate)
    app.router.add_post("/v1/chat/completions", engine.generate)
    add_dense_routes(app, engine)  # /v1/embeddings, /v1/rerank
    add_event_routes(app, engine)  # /v1/responses, /v1/messages
    return app


async def start_mock(
    config: MockConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    """Start the mock on `host:port` (0 = a free port) inside the running loop; returns (runner, base_url)."""
    # handler_cancellation: a request whose client left is cancelled at once, not at its next
    # write (which may be a TTFT, an ITL or a stall away)
    runner = web.AppRunner(make_app(config), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://{host}:{bound_port}/v1"
