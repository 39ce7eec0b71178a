"""The mock's `/v1/embeddings` and `/v1/rerank` (see `harness.targets.mock_server`).

The answer arrives whole after `ttft_ms` (with the mock's jitter) plus `itl_ms` per text
(inputs, or documents beside the query): the mock's two latency knobs read as a fixed cost
and a per-input cost, so a test knows the true latency of every request. Service starts on
arrival, or when a slot frees under `max_concurrency`, and is scheduled against that absolute
time. Vectors and scores are a pure function of each text (its sha256), unit length, so
answers are reproducible; `usage.prompt_tokens` counts the texts' whitespace-separated words
(the mock has no tokenizer).

Faults: `error` (500) and `reject` (429) as for generation; `malformed_json` answers 200 with
one vector (or score) too few, the shape a client must flag. A body that is not a request of
the route (no texts, a text that is not a string, more than `MAX_DENSE_TEXTS`) is a 400.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import struct

from aiohttp import web

MAX_DENSE_TEXTS = 2048  # the most texts one request may carry
MOCK_DIM = 8  # the mock's embedding length


def mock_vector(text: str) -> list[float]:
    """A unit vector of `MOCK_DIM` floats, a pure function of `text`."""
    digest = hashlib.sha256(text.encode()).digest()  # 32 bytes: 8 uint32
    raw = [x / 2**31 - 1.0 for x in struct.unpack("<8I", digest)]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [v / norm for v in raw]


def _texts(value, name: str) -> list[str] | str:
    """The texts of `value` (a string is one), or the sentence that says what is wrong."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        return f"{name} must be a string or a non-empty list of strings."
    if not all(isinstance(t, str) for t in value):
        return f"every item of {name} must be a string."
    if len(value) > MAX_DENSE_TEXTS:
        return f"{name} holds {len(value)} texts; the mock takes at most {MAX_DENSE_TEXTS}."
    return value


class DenseHandlers:
    """The two routes over a `MockEngine` (its config, random state, slots and counters)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def embeddings(self, request: web.Request) -> web.Response:
        return await self._handle(request, rerank=False)

    async def rerank(self, request: web.Request) -> web.Response:
        return await self._handle(request, rerank=True)

    async def _handle(self, request: web.Request, *, rerank: bool) -> web.Response:
        engine = self.engine
        start = asyncio.get_running_loop().time()
        body = await engine.admit(request)
        if isinstance(body, web.Response):
            return body
        name = "documents" if rerank else "input"
        texts = _texts(body.get(name), name)
        if isinstance(texts, str):
            return _error(400, texts, param=name)
        query = body.get("query")
        if rerank and not isinstance(query, str):
            return _error(400, "query must be a string.", param="query")
        fault = engine._draw_fault()
        if fault == "reject":
            return _error(429, "the mock's queue is full", headers={"Retry-After": "1"})
        if fault == "error":
            return _error(500, "the mock failed this request on purpose")
        if engine.slots is None:
            return await self._answer(texts, query if rerank else None, fault, start)
        async with engine.slots:
            start = max(start, asyncio.get_running_loop().time())
            return await self._answer(texts, query if rerank else None, fault, start)

    async def _answer(self, texts, query, fault, start) -> web.Response:
        engine, cfg = self.engine, self.engine.config
        loop = asyncio.get_running_loop()
        service_s = cfg.ttft_ms / 1e3 * engine._jitter() + cfg.itl_ms / 1e3 * len(texts)
        engine.running += 1
        try:
            await asyncio.sleep(max(0.0, start + service_s - loop.time()))
        finally:
            engine.running -= 1
        words = sum(len(t.split()) for t in texts) + (len(query.split()) if query else 0)
        usage = {"prompt_tokens": words, "total_tokens": words}
        shown = texts[:-1] if fault == "malformed_json" else texts
        if query is None:
            data = [
                {"object": "embedding", "index": i, "embedding": mock_vector(t)}
                for i, t in enumerate(shown)
            ]
            answer = {"object": "list", "data": data, "model": cfg.model, "usage": usage}
        else:
            q = mock_vector(query)
            scores = [sum(a * b for a, b in zip(q, mock_vector(t), strict=True)) for t in shown]
            results = [{"index": i, "relevance_score": s} for i, s in enumerate(scores)]
            results.sort(key=lambda r: -r["relevance_score"])
            answer = {"id": "rerank-mock", "model": cfg.model, "results": results, "usage": usage}
        return web.json_response(answer)


def _error(status: int, message: str, headers=None, *, param: str | None = None) -> web.Response:
    """An OpenAI error body, as the mock's generation routes answer."""
    kind = {429: "rate_limit_error", 500: "server_error"}.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def add_dense_routes(app: web.Application, engine) -> None:
    """Serve `/v1/embeddings` and `/v1/rerank` from `engine` (a `MockEngine`)."""
    handlers = DenseHandlers(engine)
    app.router.add_post("/v1/embeddings", handlers.embeddings)
    app.router.add_post("/v1/rerank", handlers.rerank)
