"""Cases at the edges of size: empty and huge prompts, stop lists and message lists, JSON nested
ten thousand levels deep, and bodies and headers past a server's HTTP limits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from faults.probe_cases.case import (
    CHAT,
    EITHER,
    LIMIT,
    LIMIT_OR_OK,
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
from faults.raw_http import LazyBody

OVERSIZED_BODY_BYTES = 64 * 1024 * 1024 + 4096  # just past a 64 MiB limit such as aiohttp's
HUGE_PROMPT_BYTES = 5 * 1024 * 1024
NUM_STOP_STRINGS = 100_000
NESTING_DEPTH = 10_000
OVERSIZED_HEADER_BYTES = 100 * 1024
NUM_EXTRA_HEADERS = 1_000
_CHUNK_BYTES = 1024 * 1024


def sizes(model: str) -> list[ProbeCase]:
    cat = Category.SIZES
    huge_prompt = "hello " * (HUGE_PROMPT_BYTES // 6)
    stops = [f"stop{i}" for i in range(NUM_STOP_STRINGS)]
    many_messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "Hello"} for i in range(10_001)
    ]

    def completion(name: str, summary: str, expect: Expect, **fields: Any) -> ProbeCase:
        return ProbeCase(name, cat, summary, expect, encode(completion_body(model, **fields)))

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
            encode(chat_body(model, messages=many_messages)),
            path=CHAT,
        ),
        ProbeCase(
            "message-content-empty",
            cat,
            'content: ""',
            EITHER,
            encode(chat_body(model, messages=[{"role": "user", "content": ""}])),
            path=CHAT,
        ),
    ]


def nesting(model: str) -> list[ProbeCase]:
    cat = Category.NESTING
    lists = b"[" * NESTING_DEPTH + b"]" * NESTING_DEPTH
    objects = b'{"a": ' * NESTING_DEPTH + b"1" + b"}" * NESTING_DEPTH
    deep = f"{NESTING_DEPTH:,} levels"
    chat = chat_body(model, messages=[{"role": "user", "content": RAW}])
    return [
        ProbeCase(
            "nested-lists-prompt",
            cat,
            f"prompt: lists {deep} deep",
            REJECT,
            spliced(completion_body(model, prompt=RAW), lists),
        ),
        ProbeCase(
            "nested-objects-stop",
            cat,
            f"stop: objects {deep} deep",
            REJECT,
            spliced(completion_body(model, stop=RAW), objects),
        ),
        ProbeCase(
            "nested-unknown-field",
            cat,
            f"an unknown field {deep} deep",
            # Nested that deep, a server may refuse to parse it at all, or ignore it.
            EITHER,
            spliced(completion_body(model, probe_nested=RAW), lists),
        ),
        ProbeCase(
            "nested-lists-content",
            cat,
            f"content: lists {deep} deep",
            REJECT,
            spliced(chat, lists),
            path=CHAT,
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


def limits(model: str) -> list[ProbeCase]:
    cat = Category.LIMITS
    good = encode(completion_body(model))
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
