"""The bad-input case table: every request `bench probe bad-input` sends, and what answer passes.

A case is data: a method, a path under the server's root, a body (bytes, or a `LazyBody`
streamed in pieces), headers, and an `Expect` saying which answers are acceptable. The common
expectation is `REJECT`: a 4xx whose body is `{"error": {"message": ...}}`. `EITHER` also
accepts a 200 with a well-formed completion, for requests a server may legitimately serve
(unknown fields, an empty prompt, an extension field it does not implement). `LIMIT` cases
(oversized body or header) may be refused at the HTTP layer, so any 4xx passes, and so does a
closed connection. Whatever the answer, the server must stay healthy afterwards (`probe.py`).

Numeric extremes follow one rule: a field every OpenAI-compatible server uses (`max_tokens`,
`n`, `logprobs`, `temperature`, `top_p`) must reject a value it cannot use; a field a server
may not implement, or may clamp (`top_k`, `seed`, the penalties, `min_tokens`), may be
ignored, so any of its values may be accepted. NaN and Infinity are sent as the bare tokens
Python's `json.dumps` writes; they are not JSON, so rejecting the whole body is also a pass.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"
JSON_TYPE = "application/json"

OVERSIZED_BODY_BYTES = 64 * 1024 * 1024 + 4096  # just past a 64 MiB limit such as aiohttp's
HUGE_PROMPT_BYTES = 5 * 1024 * 1024
NUM_STOP_STRINGS = 100_000
NESTING_DEPTH = 10_000
OVERSIZED_HEADER_BYTES = 100 * 1024
NUM_EXTRA_HEADERS = 1_000
_CHUNK_BYTES = 1024 * 1024
_RAW = "@@probe-raw@@"  # stands for a raw JSON fragment spliced into an encoded body
_DROP = object()  # a field value meaning "leave the field out"


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
class LazyBody:
    """A body generated piece by piece while it is sent; `size` None sends it chunked."""

    size: int | None
    pieces: Callable[[], Iterator[bytes]]


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


def build_cases(model: str) -> tuple[ProbeCase, ...]:
    """Every case, in the order they run, for a server serving `model`."""
    builders = (
        _malformed_json,
        _wrong_types,
        _missing_fields,
        _numeric_extremes,
        _sizes,
        _nesting,
        _encoding,
        _limits,
        _unknown_model,
        _messages,
        _unknown_fields,
        _methods,
        _content_types,
    )
    cases = tuple(case for build in builders for case in build(model))
    names = [case.name for case in cases]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Probe case names must be unique; repeated: {', '.join(duplicates)}.")
    return cases


def completion_body(model: str, /, **fields: Any) -> dict[str, Any]:
    """A well-formed short completion request with `fields` replaced (`_DROP` removes one)."""
    return _merged({"model": model, "prompt": "Hello", "max_tokens": 8}, fields)


def chat_body(model: str, /, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hello"}]
    return _merged({"model": model, "messages": messages, "max_tokens": 8}, fields)


def _merged(base: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    merged = {**base, **fields}
    return {k: v for k, v in merged.items() if v is not _DROP}


def _encode(body: Any) -> bytes:
    # allow_nan: NaN and Infinity go out as the bare tokens, as the probe means them to.
    return json.dumps(body, allow_nan=True).encode("utf-8")


def _spliced(body: dict[str, Any], raw: bytes) -> bytes:
    """`body` encoded, with the string `_RAW` (wherever it sits) replaced by the raw bytes."""
    return _encode(body).replace(json.dumps(_RAW).encode(), raw)


def _malformed_json(model: str) -> list[ProbeCase]:
    good = _encode(completion_body(model))
    chat = _encode(chat_body(model))
    cat = Category.MALFORMED_JSON
    return [
        ProbeCase(
            "truncated-json", cat, "body cut mid-string", REJECT, good[: good.index(b"Hello") + 3]
        ),
        ProbeCase("trailing-garbage", cat, "valid object then `xyz}`", REJECT, good + b" xyz}"),
        ProbeCase("two-objects", cat, "two JSON objects back to back", REJECT, good + good),
        ProbeCase("body-is-array", cat, "body is [1, 2, 3]", REJECT, b"[1, 2, 3]"),
        ProbeCase("body-is-string", cat, 'body is "hello"', REJECT, b'"hello"'),
        ProbeCase("body-is-null", cat, "body is null", REJECT, b"null"),
        ProbeCase("empty-body", cat, "no body at all", REJECT, b""),
        ProbeCase("single-quotes", cat, "Python-style quotes", REJECT, b"{'prompt': 'Hello'}"),
        ProbeCase("chat-truncated-json", cat, "chat body cut short", REJECT, chat[:-9], path=CHAT),
    ]


def _wrong_types(model: str) -> list[ProbeCase]:
    cat = Category.WRONG_TYPES

    def completion(name: str, summary: str, expect: Expect = REJECT, **fields: Any) -> ProbeCase:
        return ProbeCase(name, cat, summary, expect, _encode(completion_body(model, **fields)))

    def chat(name: str, summary: str, messages: Any) -> ProbeCase:
        body = _encode(chat_body(model, messages=messages))
        return ProbeCase(name, cat, summary, REJECT, body, path=CHAT)

    return [
        completion("prompt-number", "prompt: 42", prompt=42),
        completion("prompt-object", 'prompt: {"text": ...}', prompt={"text": "Hello"}),
        completion("prompt-null", "prompt: null", prompt=None),
        completion("prompt-bool", "prompt: true", prompt=True),
        completion("max-tokens-string", 'max_tokens: "many"', max_tokens="many"),
        # Pydantic-based servers coerce "8" to 8 in lax mode; that is lenient, not broken.
        completion("max-tokens-numeric-string", 'max_tokens: "8"', EITHER, max_tokens="8"),
        completion("max-tokens-list", "max_tokens: [8]", max_tokens=[8]),
        completion("max-tokens-bool", "max_tokens: true", max_tokens=True),
        completion("temperature-string", 'temperature: "hot"', temperature="hot"),
        completion("stop-number", "stop: 42", stop=42),
        completion("stream-string", 'stream: "maybe"', stream="maybe"),
        completion("model-number", "model: 42", model=42),
        chat("messages-string", 'messages: "Hello"', "Hello"),
        chat("message-content-number", "content: 42", [{"role": "user", "content": 42}]),
        chat("message-role-missing", "message without role", [{"content": "Hello"}]),
        chat("message-role-unknown", 'role: "wizard"', [{"role": "wizard", "content": "Hi"}]),
        chat("message-role-number", "role: 1", [{"role": 1, "content": "Hello"}]),
    ]


def _missing_fields(model: str) -> list[ProbeCase]:
    cat = Category.MISSING_FIELDS
    return [
        ProbeCase(
            "no-prompt", cat, "no prompt", REJECT, _encode(completion_body(model, prompt=_DROP))
        ),
        ProbeCase(
            "no-messages",
            cat,
            "no messages",
            REJECT,
            _encode(chat_body(model, messages=_DROP)),
            path=CHAT,
        ),
        # OpenAI requires `model`; single-model servers commonly default it.
        ProbeCase(
            "no-model", cat, "no model", EITHER, _encode(completion_body(model, model=_DROP))
        ),
        ProbeCase(
            "no-model-chat",
            cat,
            "no model",
            EITHER,
            _encode(chat_body(model, model=_DROP)),
            path=CHAT,
        ),
        ProbeCase("empty-object", cat, "body is {}", REJECT, b"{}"),
        ProbeCase("empty-object-chat", cat, "body is {}", REJECT, b"{}", path=CHAT),
    ]


_EXTREMES: tuple[tuple[str, Any], ...] = (
    ("0", 0),
    ("-1", -1),
    ("2**63", 2**63),
    ("2**64", 2**64),
    ("1e20", 1e20),
    ("NaN", math.nan),
    ("Infinity", math.inf),
)
_ALL = frozenset(label for label, _ in _EXTREMES)
_UNUSABLE = frozenset({"-1", "2**63", "2**64", "1e20", "NaN", "Infinity"})
_NOT_FINITE = frozenset({"-1", "NaN", "Infinity"})
# The extreme values each numeric field must reject; the others may be accepted or rejected.
MUST_REJECT: dict[str, frozenset[str]] = {
    "max_tokens": _UNUSABLE,
    "temperature": _NOT_FINITE,  # a huge finite temperature samples uniformly: usable
    "top_p": _UNUSABLE,
    "n": _ALL,
    "logprobs": _UNUSABLE,
    "top_k": frozenset(),
    "seed": frozenset(),
    "presence_penalty": frozenset(),
    "frequency_penalty": frozenset(),
    "min_tokens": frozenset(),
}
CHAT_MUST_REJECT: dict[str, frozenset[str]] = {
    "max_completion_tokens": _UNUSABLE,
    "top_logprobs": _UNUSABLE,
}


def _numeric_extremes(model: str) -> list[ProbeCase]:
    cat = Category.NUMERIC_EXTREMES
    cases = [
        ProbeCase(
            f"{field}={label}",
            cat,
            f"{field}: {label}",
            REJECT if label in MUST_REJECT[field] else EITHER,
            _encode(completion_body(model, **{field: value})),
        )
        for field in MUST_REJECT
        for label, value in _EXTREMES
    ]
    chat_fields = {
        "max_completion_tokens": {"max_tokens": _DROP},
        "top_logprobs": {"logprobs": True},
    }
    cases += [
        ProbeCase(
            f"{field}={label}",
            cat,
            f"chat {field}: {label}",
            REJECT if label in CHAT_MUST_REJECT[field] else EITHER,
            _encode(chat_body(model, **chat_fields[field], **{field: value})),
            path=CHAT,
        )
        for field in CHAT_MUST_REJECT
        for label, value in _EXTREMES
    ]
    for label, token in (("-1", -1), ("2**63", 2**63)):
        body = _encode(completion_body(model, prompt=[token]))
        cases.append(ProbeCase(f"prompt-token-id={label}", cat, f"prompt: [{label}]", REJECT, body))
    return cases


def _sizes(model: str) -> list[ProbeCase]:
    cat = Category.SIZES
    huge_prompt = "hello " * (HUGE_PROMPT_BYTES // 6)
    stops = [f"stop{i}" for i in range(NUM_STOP_STRINGS)]
    many_messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "Hello"} for i in range(10_001)
    ]

    def completion(name: str, summary: str, expect: Expect, **fields: Any) -> ProbeCase:
        return ProbeCase(name, cat, summary, expect, _encode(completion_body(model, **fields)))

    return [
        completion("empty-prompt", 'prompt: ""', EITHER, prompt=""),
        completion("empty-prompt-list", "prompt: []", REJECT, prompt=[]),
        completion("prompt-list-of-empty", 'prompt: [""]', EITHER, prompt=[""]),
        completion("huge-prompt-5mb", "a 5 MiB prompt", EITHER, prompt=huge_prompt),
        completion("stop-100k", f"{NUM_STOP_STRINGS:,} stop strings", EITHER, stop=stops),
        completion("stop-empty-list", "stop: []", EITHER, stop=[]),
        completion("stop-empty-string", 'stop: [""]', EITHER, stop=[""]),
        ProbeCase(
            "messages-10k",
            cat,
            "10,001 chat messages",
            EITHER,
            _encode(chat_body(model, messages=many_messages)),
            path=CHAT,
        ),
        ProbeCase(
            "message-content-empty",
            cat,
            'content: ""',
            EITHER,
            _encode(chat_body(model, messages=[{"role": "user", "content": ""}])),
            path=CHAT,
        ),
    ]


def _nesting(model: str) -> list[ProbeCase]:
    cat = Category.NESTING
    lists = b"[" * NESTING_DEPTH + b"]" * NESTING_DEPTH
    objects = b'{"a": ' * NESTING_DEPTH + b"1" + b"}" * NESTING_DEPTH
    deep = f"{NESTING_DEPTH:,} levels"
    chat = chat_body(model, messages=[{"role": "user", "content": _RAW}])
    return [
        ProbeCase(
            "nested-lists-prompt",
            cat,
            f"prompt: lists {deep} deep",
            REJECT,
            _spliced(completion_body(model, prompt=_RAW), lists),
        ),
        ProbeCase(
            "nested-objects-stop",
            cat,
            f"stop: objects {deep} deep",
            REJECT,
            _spliced(completion_body(model, stop=_RAW), objects),
        ),
        ProbeCase(
            "nested-unknown-field",
            cat,
            f"an unknown field {deep} deep",
            # Nested that deep, a server may refuse to parse it at all, or ignore it.
            EITHER,
            _spliced(completion_body(model, probe_nested=_RAW), lists),
        ),
        ProbeCase(
            "nested-lists-content",
            cat,
            f"content: lists {deep} deep",
            REJECT,
            _spliced(chat, lists),
            path=CHAT,
        ),
    ]


def _encoding(model: str) -> list[ProbeCase]:
    cat = Category.ENCODING

    def raw_prompt(name: str, summary: str, raw: bytes, expect: Expect = REJECT) -> ProbeCase:
        body = _spliced(completion_body(model, prompt=_RAW), b'"' + raw + b'"')
        return ProbeCase(name, cat, summary, expect, body)

    chat = chat_body(model, messages=[{"role": "user", "content": _RAW}])
    return [
        raw_prompt("invalid-utf8-bytes", "prompt holds bytes ff fe", b"Hi \xff\xfe there"),
        raw_prompt("overlong-utf8", "prompt holds overlong c0 af", b"Hi \xc0\xaf"),
        raw_prompt("utf8-encoded-surrogate", "prompt holds ed a0 80", b"Hi \xed\xa0\x80"),
        raw_prompt("truncated-utf8", "prompt ends inside a character", b"Hi \xe2\x82"),
        ProbeCase(
            "invalid-utf8-chat",
            cat,
            "content holds byte ff",
            REJECT,
            _spliced(chat, b'"Hi \xff"'),
            path=CHAT,
        ),
        ProbeCase(
            "invalid-utf8-key",
            cat,
            "a field name holds byte ff",
            REJECT,
            _spliced(completion_body(model, probe=_RAW), b"1").replace(b'"probe"', b'"pr\xffbe"'),
        ),
        # Valid JSON escapes that are not valid text: a server may reject or replace them.
        raw_prompt("lone-surrogate-escape", r'prompt holds "\ud800"', rb"Hi \ud800", EITHER),
        raw_prompt("nul-escape", r'prompt holds "\u0000"', rb"Hi \u0000", EITHER),
        ProbeCase(
            "utf16-body",
            cat,
            "the body encoded as UTF-16",
            EITHER,  # JSON must be UTF-8 (RFC 8259), but some parsers detect UTF-16
            json.dumps(completion_body(model)).encode("utf-16"),
        ),
    ]


def _oversized_pieces(model: str) -> Iterator[bytes]:
    head = f'{{"model": {json.dumps(model)}, "max_tokens": 8, "prompt": "'.encode()
    filler = OVERSIZED_BODY_BYTES - len(head) - 2
    yield head
    piece = b"a" * _CHUNK_BYTES
    while filler > 0:
        yield piece[:filler]
        filler -= len(piece)
    yield b'"}'


def _limits(model: str) -> list[ProbeCase]:
    cat = Category.LIMITS
    good = _encode(completion_body(model))
    mib = OVERSIZED_BODY_BYTES / 2**20
    return [
        ProbeCase(
            "body-64mb",
            cat,
            f"a {mib:.0f} MiB body with Content-Length",
            LIMIT,
            LazyBody(OVERSIZED_BODY_BYTES, lambda: _oversized_pieces(model)),
        ),
        ProbeCase(
            "body-64mb-chunked",
            cat,
            f"a {mib:.0f} MiB body, chunked",
            LIMIT,
            LazyBody(None, lambda: _oversized_pieces(model)),
        ),
        ProbeCase(
            "header-100kb",
            cat,
            f"one {OVERSIZED_HEADER_BYTES // 1024} KiB header",
            LIMIT,
            good,
            headers=(("X-Probe-Padding", "a" * OVERSIZED_HEADER_BYTES),),
        ),
        ProbeCase(
            "headers-1000",
            cat,
            f"{NUM_EXTRA_HEADERS:,} extra headers",
            LIMIT_OR_OK,
            good,
            headers=tuple((f"X-Probe-{i}", "1") for i in range(NUM_EXTRA_HEADERS)),
        ),
    ]


def _unknown_model(model: str) -> list[ProbeCase]:
    cat = Category.UNKNOWN_MODEL
    other = "no-such-model-probe"
    return [
        ProbeCase(
            "unknown-model",
            cat,
            f"model: {other!r}",
            REJECT,
            _encode(completion_body(model, model=other)),
        ),
        ProbeCase(
            "unknown-model-chat",
            cat,
            f"model: {other!r}",
            REJECT,
            _encode(chat_body(model, model=other)),
            path=CHAT,
        ),
        ProbeCase(
            "model-empty-string",
            cat,
            'model: ""',
            EITHER,  # some servers read "" as "the default model"
            _encode(completion_body(model, model="")),
        ),
    ]


def _messages(model: str) -> list[ProbeCase]:
    cat = Category.MESSAGES

    def chat(name: str, summary: str, messages: Any, expect: Expect = REJECT) -> ProbeCase:
        return ProbeCase(
            name, cat, summary, expect, _encode(chat_body(model, messages=messages)), path=CHAT
        )

    return [
        chat("messages-empty-list", "messages: []", []),
        chat("messages-null", "messages: null", None),
        chat(
            "messages-object", "messages: one object, not a list", {"role": "user", "content": "Hi"}
        ),
        chat("message-null", "messages: [null]", [None]),
        chat("message-empty-object", "messages: [{}]", [{}]),
        chat("message-is-string", 'messages: ["Hello"]', ["Hello"]),
        chat("message-no-content", "a user message without content", [{"role": "user"}], EITHER),
        chat("content-parts-not-objects", "content: [1, 2]", [{"role": "user", "content": [1, 2]}]),
        chat(
            "content-part-unknown-type",
            'content: [{"type": "nonsense"}]',
            [{"role": "user", "content": [{"type": "nonsense", "text": "Hi"}]}],
        ),
        chat(
            "content-part-text-number",
            'content: [{"type": "text", "text": 42}]',
            [{"role": "user", "content": [{"type": "text", "text": 42}]}],
        ),
    ]


def _unknown_fields(model: str) -> list[ProbeCase]:
    cat = Category.UNKNOWN_FIELDS
    nested = {"deep": [1, {"x": None}], "y": "z"}
    message = [{"role": "user", "content": "Hello", "probe_unknown": 1}]
    return [
        ProbeCase(
            "unknown-field",
            cat,
            "probe_unknown: true",
            EITHER,
            _encode(completion_body(model, probe_unknown=True)),
        ),
        ProbeCase(
            "unknown-field-object",
            cat,
            "probe_unknown: an object",
            EITHER,
            _encode(completion_body(model, probe_unknown=nested)),
        ),
        ProbeCase(
            "unknown-field-chat",
            cat,
            "probe_unknown: true",
            EITHER,
            _encode(chat_body(model, probe_unknown=True)),
            path=CHAT,
        ),
        ProbeCase(
            "unknown-message-field",
            cat,
            "a message with an unknown field",
            EITHER,
            _encode(chat_body(model, messages=message)),
            path=CHAT,
        ),
    ]


def _methods(model: str) -> list[ProbeCase]:
    cat = Category.METHODS
    good = _encode(completion_body(model))
    return [
        ProbeCase("get-completions", cat, "GET, no body", REJECT, method="GET", content_type=None),
        ProbeCase("put-completions", cat, "PUT, a valid body", REJECT, good, method="PUT"),
        ProbeCase(
            "delete-chat",
            cat,
            "DELETE, no body",
            REJECT,
            path=CHAT,
            method="DELETE",
            content_type=None,
        ),
        ProbeCase("post-models", cat, "POST to the model list", REJECT, good, path=MODELS),
    ]


def _content_types(model: str) -> list[ProbeCase]:
    cat = Category.CONTENT_TYPES
    good = _encode(completion_body(model))
    form = f"model={model}&prompt=Hello&max_tokens=8".encode()
    return [
        # A valid JSON body under another content type: reading it or refusing it both pass.
        ProbeCase(
            "text-plain", cat, "JSON body as text/plain", EITHER, good, content_type="text/plain"
        ),
        ProbeCase(
            "no-content-type", cat, "JSON body, no Content-Type", EITHER, good, content_type=None
        ),
        ProbeCase(
            "json-as-form-type",
            cat,
            "JSON body as form-encoded",
            EITHER,
            good,
            content_type="application/x-www-form-urlencoded",
        ),
        ProbeCase(
            "form-encoded",
            cat,
            "a form-encoded body",
            REJECT,
            form,
            content_type="application/x-www-form-urlencoded",
        ),
        ProbeCase(
            "multipart",
            cat,
            "a multipart body",
            REJECT,
            b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nHello\r\n--b--\r\n',
            content_type="multipart/form-data; boundary=b",
        ),
    ]
