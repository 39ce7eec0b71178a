"""`POST /v1/embeddings` and `POST /v1/rerank`: the engine's pooled last hidden state, served.

- `/v1/embeddings` (OpenAI's shape): `input` is a string or a list of strings; each gets the
  mean over its tokens of the model's last hidden state (after the final norm), L2-normalised
  to unit length (`engine_ref.core.pooling`). `encoding_format` is `float` (default) or
  `base64` (little-endian float32). `usage.prompt_tokens` counts every input's tokens.
- `/v1/rerank` (the Jina/Cohere shape vLLM and TEI serve): `query` and `documents` (strings),
  optional `top_n` and `return_documents`; each document's `relevance_score` is the cosine
  similarity of its embedding and the query's, results best first. This is a bi-encoder
  stand-in for a reranker so the harness's rerank path runs against a real model: a real
  reranker is a cross-encoder that reads query and document together. `usage.prompt_tokens`
  counts the query once and every document.

Bounds (each a 400 with one sentence): at least one text and at most `MAX_DENSE_TEXTS`; every
text a string that encodes to at least one token and at most the context length (a pooled
prompt needs no room for a completion, so exactly the context length is accepted); the
request's characters at most the server's `max_prompt_chars`. The forward runs on the engine's
thread between steps (`EngineLoop.pool`), so a batch delays the streams in flight by its own
cost, bounded by these limits.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine_ref.serving.engine_loop import EngineLoopError
from engine_ref.serving.errors import ApiError
from engine_ref.serving.fields import check_encodable
from engine_ref.serving.interface import EngineError, ServedTokenizer
from engine_ref.serving.middlewares import json_response
from engine_ref.serving.requests import decode_json_body

MAX_DENSE_TEXTS = 256  # texts one request may carry: inputs, or documents beside the query
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class DenseRequest:
    """A validated embeddings or rerank body: the prompts to pool (for rerank the query is
    first), and how to answer."""

    rerank: bool
    prompts: tuple[tuple[int, ...], ...]
    encoding_format: str = "float"
    top_n: int | None = None
    documents: tuple[str, ...] | None = None  # rerank with `return_documents`

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _check_model(body: dict[str, Any], served_model: str) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string.", param="model")
    if model is not None and model != served_model:
        raise ApiError(
            404,
            f"The model {model!r} does not exist; this server serves {served_model!r}.",
            param="model",
            code="model_not_found",
        )


def _texts(value: Any, param: str, *, allow_one: bool) -> list[str]:
    if allow_one and isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        one = "a string or " if allow_one else ""
        raise ApiError(400, f"{param} must be {one}a non-empty list of strings.", param=param)
    if len(value) > MAX_DENSE_TEXTS:
        raise ApiError(
            400,
            f"{param} has {len(value)} texts; at most {MAX_DENSE_TEXTS} are allowed per request.",
            param=param,
        )
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise ApiError(400, f"{param}[{i}] must be a string, got {type(text).__name__}.", param=param)  # fmt: skip
        check_encodable(text, param)
    return value


def _encode(
    tokenizer: ServedTokenizer, texts: list[str], param: str, max_model_len: int
) -> list[tuple[int, ...]]:
    encode_batch = getattr(tokenizer, "encode_batch", None)  # releases the GIL where it exists
    encoded = encode_batch(texts) if encode_batch else [tokenizer.encode(t) for t in texts]
    for i, ids in enumerate(encoded):
        name = param if param == "query" else f"{param}[{i}]"
        if not ids:
            raise ApiError(400, f"{name} is empty: there is no token to pool.", param=param)
        if len(ids) > max_model_len:
            raise ApiError(
                400,
                f"{name} has {len(ids)} tokens, more than this model's context length of "
                f"{max_model_len}; shorten it.",
                param=param,
                code="context_length_exceeded",
            )
    return [tuple(ids) for ids in encoded]


def parse_dense_request(
    body: dict[str, Any],
    *,
    rerank: bool,
    tokenizer: ServedTokenizer,
    served_model: str,
    max_model_len: int,
    max_prompt_chars: int | None = None,
) -> DenseRequest:
    """Validate and tokenize an embeddings (`rerank` False) or rerank body; ApiError 400/404."""
    _check_model(body, served_model)
    if rerank:
        query = body.get("query")
        if not isinstance(query, str):
            raise ApiError(400, "query must be a string.", param="query")
        check_encodable(query, "query")
        texts, param = _texts(body.get("documents"), "documents", allow_one=False), "documents"
    else:
        texts, param = _texts(body.get("input"), "input", allow_one=True), "input"
    chars = sum(len(t) for t in texts) + (len(query) if rerank else 0)
    if max_prompt_chars is not None and chars > max_prompt_chars:
        raise ApiError(
            400,
            f"The request's texts have {chars} characters; this server accepts at most "
            f"{max_prompt_chars} per request (--max-prompt-chars).",
            param=param,
            code="context_length_exceeded",
        )
    encoding = body.get("encoding_format", "float") if not rerank else "float"
    if encoding not in ENCODING_FORMATS:
        raise ApiError(400, f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}.", param="encoding_format")  # fmt: skip
    if not rerank and body.get("dimensions") is not None:
        raise ApiError(400, "dimensions is not supported: the vectors have the model's hidden size.", param="dimensions")  # fmt: skip
    top_n = body.get("top_n") if rerank else None
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise ApiError(400, "top_n must be a whole number of at least 1.", param="top_n")
    prompts = _encode(tokenizer, texts, param, max_model_len)
    if rerank:
        prompts = _encode(tokenizer, [query], "query", max_model_len) + prompts
    documents = tuple(texts) if rerank and body.get("return_documents") else None
    return DenseRequest(rerank, tuple(prompts), encoding, top_n, documents)


def _vector(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def dense_response(request: DenseRequest, vectors: list[list[float]], model: str) -> dict:
    """The answer body for `request` given one unit vector per prompt (query first)."""
    usage = {"prompt_tokens": request.prompt_tokens, "total_tokens": request.prompt_tokens}
    if not request.rerank:
        data = [
            {"object": "embedding", "index": i, "embedding": _vector(v, request.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        return {
            "id": "embd-" + uuid.uuid4().hex,
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": usage,
        }
    query, documents = vectors[0], vectors[1:]
    results = []
    for i, doc in enumerate(documents):  # unit vectors: the dot product is the cosine
        result = {
            "index": i,
            "relevance_score": sum(q * d for q, d in zip(query, doc, strict=True)),
        }
        if request.documents is not None:
            result["document"] = {"text": request.documents[i]}
        results.append(result)
    results.sort(key=lambda r: -r["relevance_score"])
    if request.top_n is not None:
        results = results[: request.top_n]
    return {"id": "rerank-" + uuid.uuid4().hex, "model": model, "usage": usage, "results": results}


DENSE_PATHS = {False: "/v1/embeddings", True: "/v1/rerank"}


def dense_handler(
    rerank: bool, state_of: Callable[[web.Request], Any]
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The handler of `/v1/rerank` (`rerank`) or `/v1/embeddings`; `state_of(request)` gives
    the server's state (its engine loop, config, served model name and parser threads)."""

    async def handle(request: web.Request) -> web.Response:
        state = state_of(request)
        info = state.engine_loop.info
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise ApiError(413, f"The request body exceeds this server's limit of {state.config.max_body_bytes} bytes (--max-body-bytes).", code="request_too_large") from None  # fmt: skip

            def parse() -> DenseRequest:  # in a parser thread: tokenizing may be long
                return parse_dense_request(
                    decode_json_body(raw),
                    rerank=rerank,
                    tokenizer=info.tokenizer,
                    served_model=state.served_model_name,
                    max_model_len=info.max_model_len,
                    max_prompt_chars=state.config.max_prompt_chars,
                )

            dense = await asyncio.get_running_loop().run_in_executor(state.parser, parse)
            try:
                vectors = await state.engine_loop.pool(uuid.uuid4().hex, list(dense.prompts))
            except EngineError as exc:
                raise ApiError(501, str(exc), type="server_error") from None
            except EngineLoopError as exc:
                raise ApiError(503, str(exc), type="server_error") from None
        except ApiError as error:
            return json_response(error.body(), status=error.status, headers=error.headers)
        return json_response(dense_response(dense, vectors, state.served_model_name))

    return handle
