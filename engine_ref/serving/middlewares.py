"""Request middlewares of the server: OpenAI error bodies for every error answer, and the API
key check of `--api-key`."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Any

from aiohttp import web

from engine_ref.serving.errors import error_body

LOG = logging.getLogger("engine_ref.serving.server")


def json_response(
    body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=json.dumps(body, ensure_ascii=False).encode("utf-8"),
        status=status,
        headers=headers,
        content_type="application/json",
    )


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error answer carries an OpenAI error body: aiohttp's own (unknown path, wrong
    method, body too large) and any unexpected exception (500; the server keeps serving)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        message = f"{exc.reason} ({request.method} {request.path})."
        return json_response(error_body(message, type=kind), status=exc.status)
    except Exception as exc:
        LOG.exception("unexpected error serving %s %s", request.method, request.path)
        message = f"Internal server error: {type(exc).__name__}: {exc}."
        return json_response(error_body(message, type="server_error"), status=500)


def api_key_guard(api_key: str) -> Any:
    """A middleware answering 401 to any /v1/* request without `Authorization: Bearer
    <api_key>` (or, as Anthropic's clients send it, `x-api-key: <api_key>`); other paths (/health, /metrics, /info) stay open, as in vLLM. The keys are
    compared as SHA-256 digests in constant time, so neither their bytes nor their length
    show in the answer's timing."""
    expected = hashlib.sha256(api_key.encode("utf-8")).digest()

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        if not (request.path == "/v1" or request.path.startswith("/v1/")):
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" and "x-api-key" in request.headers:
            scheme, token = "bearer", request.headers["x-api-key"]  # Anthropic's clients
        given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        if scheme.lower() == "bearer" and hmac.compare_digest(given, expected):
            return await handler(request)
        body = error_body(
            "Missing or incorrect API key; send it as `Authorization: Bearer <key>`.",
            type="invalid_request_error",
            code="invalid_api_key",
        )
        return json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})

    return guard
