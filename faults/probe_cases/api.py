"""Cases a well-formed JSON body can still get wrong for the API: an unknown model, chat
messages of the wrong shape, unknown fields, the wrong method, and other content types."""

from __future__ import annotations

from typing import Any

from faults.probe_cases.case import (
    CHAT,
    EITHER,
    MODELS,
    REJECT,
    Category,
    Expect,
    ProbeCase,
    chat_body,
    completion_body,
    encode,
)


def unknown_model(model: str) -> list[ProbeCase]:
    cat = Category.UNKNOWN_MODEL
    other = "no-such-model-probe"
    return [
        ProbeCase(
            "unknown-model",
            cat,
            f"model: {other!r}",
            REJECT,
            encode(completion_body(model, model=other)),
        ),
        ProbeCase(
            "unknown-model-chat",
            cat,
            f"model: {other!r}",
            REJECT,
            encode(chat_body(model, model=other)),
            path=CHAT,
        ),
        ProbeCase(
            "model-empty-string",
            cat,
            'model: ""',
            EITHER,  # some servers read "" as "the default model"
            encode(completion_body(model, model="")),
        ),
    ]


def messages(model: str) -> list[ProbeCase]:
    cat = Category.MESSAGES

    def chat(name: str, summary: str, messages: Any, expect: Expect = REJECT) -> ProbeCase:
        return ProbeCase(
            name, cat, summary, expect, encode(chat_body(model, messages=messages)), path=CHAT
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


def unknown_fields(model: str) -> list[ProbeCase]:
    cat = Category.UNKNOWN_FIELDS
    nested = {"deep": [1, {"x": None}], "y": "z"}
    message = [{"role": "user", "content": "Hello", "probe_unknown": 1}]
    return [
        ProbeCase(
            "unknown-field",
            cat,
            "probe_unknown: true",
            EITHER,
            encode(completion_body(model, probe_unknown=True)),
        ),
        ProbeCase(
            "unknown-field-object",
            cat,
            "probe_unknown: an object",
            EITHER,
            encode(completion_body(model, probe_unknown=nested)),
        ),
        ProbeCase(
            "unknown-field-chat",
            cat,
            "probe_unknown: true",
            EITHER,
            encode(chat_body(model, probe_unknown=True)),
            path=CHAT,
        ),
        ProbeCase(
            "unknown-message-field",
            cat,
            "a message with an unknown field",
            EITHER,
            encode(chat_body(model, messages=message)),
            path=CHAT,
        ),
    ]


def methods(model: str) -> list[ProbeCase]:
    cat = Category.METHODS
    good = encode(completion_body(model))
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


def content_types(model: str) -> list[ProbeCase]:
    cat = Category.CONTENT_TYPES
    good = encode(completion_body(model))
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
