"""Cases whose body is not the JSON a server expects: malformed JSON, fields of the wrong type,
missing fields, and bytes that are not UTF-8 text."""

from __future__ import annotations

import json
from typing import Any

from faults.probe_cases.case import (
    CHAT,
    DROP,
    EITHER,
    RAW,
    REJECT,
    Category,
    Expect,
    ProbeCase,
    chat_body,
    completion_body,
    encode,
    spliced,
)


def malformed_json(model: str) -> list[ProbeCase]:
    good = encode(completion_body(model))
    chat = encode(chat_body(model))
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


def wrong_types(model: str) -> list[ProbeCase]:
    cat = Category.WRONG_TYPES

    def completion(name: str, summary: str, expect: Expect = REJECT, **fields: Any) -> ProbeCase:
        return ProbeCase(name, cat, summary, expect, encode(completion_body(model, **fields)))

    def chat(name: str, summary: str, messages: Any) -> ProbeCase:
        body = encode(chat_body(model, messages=messages))
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


def missing_fields(model: str) -> list[ProbeCase]:
    cat = Category.MISSING_FIELDS
    return [
        ProbeCase(
            "no-prompt", cat, "no prompt", REJECT, encode(completion_body(model, prompt=DROP))
        ),
        ProbeCase(
            "no-messages",
            cat,
            "no messages",
            REJECT,
            encode(chat_body(model, messages=DROP)),
            path=CHAT,
        ),
        # OpenAI requires `model`; single-model servers commonly default it.
        ProbeCase("no-model", cat, "no model", EITHER, encode(completion_body(model, model=DROP))),
        ProbeCase(
            "no-model-chat",
            cat,
            "no model",
            EITHER,
            encode(chat_body(model, model=DROP)),
            path=CHAT,
        ),
        ProbeCase("empty-object", cat, "body is {}", REJECT, b"{}"),
        ProbeCase("empty-object-chat", cat, "body is {}", REJECT, b"{}", path=CHAT),
    ]


def encoding(model: str) -> list[ProbeCase]:
    cat = Category.ENCODING

    def raw_prompt(name: str, summary: str, raw: bytes, expect: Expect = REJECT) -> ProbeCase:
        body = spliced(completion_body(model, prompt=RAW), b'"' + raw + b'"')
        return ProbeCase(name, cat, summary, expect, body)

    chat = chat_body(model, messages=[{"role": "user", "content": RAW}])
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
            spliced(chat, b'"Hi \xff"'),
            path=CHAT,
        ),
        ProbeCase(
            "invalid-utf8-key",
            cat,
            "a field name holds byte ff",
            REJECT,
            spliced(completion_body(model, probe=RAW), b"1").replace(b'"probe"', b'"pr\xffbe"'),
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
