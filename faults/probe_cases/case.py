"""What a probe case is: a request (method, path, body, headers) and the `Expect`ation saying
which answers pass, and the helpers the case modules build well-formed bodies with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from faults.raw_http import JSON_TYPE, LazyBody

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
RAW = "@@probe-raw@@"  # stands for a raw JSON fragment spliced into an encoded body
DROP = object()  # a field value meaning "leave the field out"


class Category(StrEnum):
    MALFORMED_JSON = "malformed-json"
    WRONG_TYPES = "wrong-types"
    MISSING_FIELDS = "missing-fields"
    NUMERIC_EXTREMES = "numeric-extremes"
    SIZES = "sizes"
    NESTING = "nesting"
    ENCODING = "encoding"
    LIMITS = "limits"
    UNKNOWN_MODEL = "unknown-model"
    MESSAGES = "messages"
    UNKNOWN_FIELDS = "unknown-fields"
    METHODS = "methods"
    CONTENT_TYPES = "content-types"
    EVENT_APIS = "event-apis"  # the Responses and Messages routes (`events`)
    DENSE_APIS = "dense-apis"  # the embeddings and rerank routes (`dense`)


@dataclass(frozen=True)
class Expect:
    """Which answers pass. `ok_allowed`: a 2xx carrying a completion (a `choices` list).
    `error_body_required`: a 4xx must carry `{"error": {"message": str}}`. `close_allowed`: the
    server may close the connection without answering. A 5xx or no answer never passes."""

    ok_allowed: bool
    error_body_required: bool
    close_allowed: bool
    label: str


REJECT = Expect(ok_allowed=False, error_body_required=True, close_allowed=False, label="4xx")
EITHER = Expect(ok_allowed=True, error_body_required=True, close_allowed=False, label="200|4xx")
LIMIT = Expect(ok_allowed=False, error_body_required=False, close_allowed=True, label="4xx|close")
LIMIT_OR_OK = Expect(
    ok_allowed=True, error_body_required=False, close_allowed=True, label="200|4xx|close"
)


@dataclass(frozen=True)
class ProbeCase:
    """One bad request. `path` is under the server root (`/v1/...`); `content_type` None sends
    no Content-Type header; `headers` are extra header lines, sent as given."""

    name: str
    category: Category
    summary: str
    expect: Expect
    body: bytes | LazyBody = b""
    path: str = COMPLETIONS
    method: str = "POST"
    content_type: str | None = JSON_TYPE
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def body_size(self) -> int | None:
        return self.body.size if isinstance(self.body, LazyBody) else len(self.body)


def completion_body(model: str, /, **fields: Any) -> dict[str, Any]:
    """A well-formed short completion request with `fields` replaced (`DROP` removes one)."""
    return _merged({"model": model, "prompt": "Hello", "max_tokens": 8}, fields)


def chat_body(model: str, /, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hello"}]
    return _merged({"model": model, "messages": messages, "max_tokens": 8}, fields)


def _merged(base: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    merged = {**base, **fields}
    return {k: v for k, v in merged.items() if v is not DROP}


def encode(body: Any) -> bytes:
    # allow_nan: NaN and Infinity go out as the bare tokens, as the probe means them to.
    return json.dumps(body, allow_nan=True).encode("utf-8")


def spliced(body: dict[str, Any], raw: bytes) -> bytes:
    """`body` encoded, with the string `RAW` (wherever it sits) replaced by the raw bytes."""
    return encode(body).replace(json.dumps(RAW).encode(), raw)
