"""The typed-event APIs, OpenAI's Responses and Anthropic's Messages: request bodies, headers,
and parsers into the same `ParsedStream` the chat and completions parser fills.

Both stream server-sent events whose JSON names its own `type` (`response.output_text.delta`,
`content_block_delta`), end with a terminal event instead of `[DONE]`, and count usage under
their own names, so records, metrics and checks downstream read them as any other stream once
parsed here. The compiled scanner reads OpenAI chunk streams only; these go through
`split_events` and the readers below (a stream is parsed once, after its request is done).

A chunk is every data event but Anthropic's `ping` (a keep-alive); an event carrying text
counts one token (`CHUNK_COUNT`: neither API says how many tokens a delta holds, so the run's
tokenizer recounts them where it has one). The record's finish reason is what the server said:
Messages' `stop_reason` (`end_turn`, `max_tokens`, ...); for Responses the terminal status
(`completed`) or, for an incomplete response, its reason (`max_output_tokens`).

Usage is mapped onto the names the run records keep. Responses: prompt `input_tokens`,
completion `output_tokens`, cached `input_tokens_details.cached_tokens`. Messages: completion
`output_tokens` (cumulative, last said by `message_delta`); prompt `input_tokens` plus
`cache_creation_input_tokens` and `cache_read_input_tokens`, which Anthropic counts apart from
it; cached `cache_read_input_tokens`. engine_ref's `kv_memory` extension is kept as it is.
"""

from __future__ import annotations

import orjson

from harness.http.sse import DONE, ParsedStream, parse_body, parse_stream, split_events
from slo.runrecord import Endpoint, ErrorClass, TokenSource
from workloads.constraint import request_fields

ANTHROPIC_VERSION = "2023-06-01"
TYPED_ENDPOINTS = (Endpoint.RESPONSES, Endpoint.MESSAGES)
# Endpoints whose server renders the prompt with the model's chat template (one user message).
CHAT_TEMPLATED = (Endpoint.CHAT, *TYPED_ENDPOINTS)

Failure = tuple[ErrorClass, str]  # how a stream failed, and a sentence saying so

_TERMINAL = {
    Endpoint.RESPONSES: ("response.completed", "response.incomplete"),
    Endpoint.MESSAGES: ("message_stop",),
}


def typed_body_fields(endpoint: Endpoint, model: str, spec: dict, *, stream: bool) -> dict:
    """The JSON body of one RequestSpec row (a dict) for a typed-event endpoint: the prompt as
    the one user input, the output bound under the API's name, the sampling fields as chat
    sends them, and `stream: true` when streaming. The tenant goes where each API keeps the
    end user (`user`; Messages' `metadata.user_id`)."""
    max_tokens = int(spec["max_output_tokens"])
    if endpoint is Endpoint.RESPONSES:
        body: dict = {"model": model, "input": spec["prompt"], "max_output_tokens": max_tokens}
    elif endpoint is Endpoint.MESSAGES:
        messages = [{"role": "user", "content": spec["prompt"]}]
        body = {"model": model, "messages": messages, "max_tokens": max_tokens}
    else:
        raise ValueError(f"{endpoint.value} is not a typed-event endpoint")
    if stream:
        body["stream"] = True
    if spec.get("ignore_eos"):
        body["ignore_eos"] = True
    for key in ("temperature", "top_p", "seed", "priority"):
        if spec.get(key) is not None:
            body[key] = spec[key]
    if spec.get("tenant") is not None:
        if endpoint is Endpoint.MESSAGES:
            body["metadata"] = {"user_id": spec["tenant"]}
        else:
            body["user"] = spec["tenant"]
    if spec.get("constraint"):
        body.update(request_fields(spec["constraint"]))
    return body


def typed_sessions_refusal(endpoint: Endpoint) -> str:
    """Why a multi-turn workload is not driven through a typed-event endpoint (one sentence)."""
    return (
        f"--endpoint {endpoint.value} sends single-turn requests; a multi-turn sessions "
        "workload carries each session's history, which this harness sends through chat or "
        "completions only: use --endpoint chat."
    )


def endpoint_headers(endpoint: Endpoint, api_key: str | None) -> dict[str, str]:
    """The headers that carry the key and API version: Messages sends the key as `x-api-key`
    (no bearer token) with `anthropic-version`; every other endpoint `Authorization: Bearer`."""
    if endpoint is Endpoint.MESSAGES:
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        return headers
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def parse_answer_stream(
    reads: list[tuple[int, bytes]], endpoint: Endpoint, *, chat: bool
) -> ParsedStream:
    """A whole streamed answer, parsed by the reader of its API: a typed-event `endpoint`'s,
    else the OpenAI chunk parser's for chat (`chat`) or completions."""
    if endpoint in TYPED_ENDPOINTS:
        return parse_typed_stream(reads, endpoint)
    return parse_stream(reads, chat=chat)


def parse_answer_body(body: bytes, endpoint: Endpoint, *, chat: bool) -> ParsedStream:
    """A whole non-streamed answer, parsed as `parse_answer_stream` parses a stream."""
    if endpoint in TYPED_ENDPOINTS:
        return parse_typed_body(body, endpoint)
    return parse_body(body, chat=chat)


class _Reader:
    """One typed stream's state while its events are read, in order."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.out = ParsedStream()
        self.raw_usage: dict = {}
        self.terminal = False

    def read(self, obj: dict) -> tuple[str | None, Failure | None]:
        """The text `obj` carries (None: none), and how the stream failed there (None: it did
        not). Raises nothing: a value of the wrong type is a failure."""
        kind = obj.get("type")
        if type(kind) is not str:
            return None, (ErrorClass.MALFORMED_JSON, "an event has no type")
        if self.endpoint is Endpoint.RESPONSES:
            return self._responses(kind, obj)
        return self._messages(kind, obj)

    def _responses(self, kind: str, obj: dict) -> tuple[str | None, Failure | None]:
        if kind == "response.output_text.delta":
            return _text(obj.get("delta"))
        response = obj.get("response")
        response = response if type(response) is dict else {}
        if self.out.response_id is None and type(response.get("id")) is str:
            self.out.response_id = response["id"]
        if kind in _TERMINAL[Endpoint.RESPONSES]:
            self.terminal = True
            self.out.finish_reason = _responses_finish(response)
            if type(response.get("usage")) is dict:
                self.raw_usage = response["usage"]
        elif kind == "response.failed":
            return None, _stream_error(response.get("error") or "the response failed")
        elif kind == "error":
            return None, _stream_error(obj.get("error") or obj)
        return None, None

    def _messages(self, kind: str, obj: dict) -> tuple[str | None, Failure | None]:
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if type(delta) is dict and delta.get("type") == "text_delta":
                return _text(delta.get("text"))
            return None, None  # another kind of block (a tool's JSON, a thinking block)
        if kind == "message_start":
            message = obj.get("message")
            message = message if type(message) is dict else {}
            if type(message.get("id")) is str:
                self.out.response_id = message["id"]
            self._add_usage(message.get("usage"))
        elif kind == "message_delta":
            delta = obj.get("delta")
            if type(delta) is dict and type(delta.get("stop_reason")) is str:
                self.out.finish_reason = delta["stop_reason"]
            self._add_usage(obj.get("usage"))
        elif kind == "message_stop":
            self.terminal = True
        elif kind == "error":
            return None, _stream_error(obj.get("error") or obj)
        return None, None

    def _add_usage(self, usage) -> None:
        if type(usage) is dict:
            self.raw_usage.update({k: v for k, v in usage.items() if v is not None})


def _text(value) -> tuple[str | None, Failure | None]:
    if value is None or type(value) is str:
        return value or None, None
    return None, (ErrorClass.MALFORMED_JSON, "an event's text is not a string")


def _stream_error(error) -> Failure:
    return ErrorClass.STREAM_ERROR, _error_text(error)


def _responses_finish(response: dict) -> str | None:
    details = response.get("incomplete_details")
    if type(details) is dict and type(details.get("reason")) is str:
        return details["reason"]
    status = response.get("status")
    return status if type(status) is str else None


def parse_typed_stream(reads: list[tuple[int, bytes]], endpoint: Endpoint) -> ParsedStream:
    """Parse a whole streamed answer of the Responses or Messages API (see the module's
    docstring for what is counted and how usage is named). A stream without its terminal
    event (`response.completed` or `response.incomplete`; `message_stop`) is
    INCOMPLETE_STREAM; `response.failed` or an `error` event is STREAM_ERROR, and keeps no
    chunk, as a failed OpenAI stream keeps none; a `[DONE]` some servers add is ignored."""
    reader = _Reader(endpoint)
    out = reader.out
    events, trailing, problem = split_events(reads)
    times: list[int] = []
    chars: list[int] = []
    text_ids: list[int] = []
    texts: dict[str, int] = {}
    parts: list[str] = []
    for t_ns, payload in events:
        if payload == DONE:
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            out.text = "".join(parts)
            return _fail(out, ErrorClass.MALFORMED_JSON, f"an event is not JSON: {payload[:60]!r}")
        if type(obj) is not dict:
            out.text = "".join(parts)
            return _fail(out, ErrorClass.MALFORMED_JSON, "an event is JSON but not an object")
        if obj.get("type") == "ping":
            continue
        if reader.terminal:
            out.text = "".join(parts)
            return _fail(out, ErrorClass.MALFORMED_SSE, "the stream sent data after its last event")
        text, failure = reader.read(obj)
        if failure is not None:
            out.text = "".join(parts)
            return _fail(out, *failure)
        times.append(t_ns)
        chars.append(len(text) if text else 0)
        if text:
            parts.append(text)
            text_ids.append(texts.setdefault(text, len(texts)))
        else:
            text_ids.append(-1)
    out.text = "".join(parts)
    out.texts = list(texts)
    out.usage = _usage(endpoint, reader.raw_usage)
    out.saw_done = reader.terminal
    out.set_chunks(times, [1 if c else 0 for c in chars], chars, text_ids)
    if parts:
        out.chunk_tokens_source = TokenSource.CHUNK_COUNT
    if problem is not None:
        return _fail(out, ErrorClass.MALFORMED_SSE, problem)
    if trailing.strip():
        return _fail(out, ErrorClass.INCOMPLETE_STREAM, "the stream ended inside an event")
    if not reader.terminal:
        last = " or ".join(_TERMINAL[endpoint])
        return _fail(out, ErrorClass.INCOMPLETE_STREAM, f"the stream ended before {last}")
    return out


def parse_typed_body(body: bytes, endpoint: Endpoint) -> ParsedStream:
    """Parse a non-streamed answer of the Responses API (a `response` object: the text of its
    `output_text` parts) or of the Messages API (a `message`: its `text` blocks) into the same
    shape as a stream; an answer whose status is `failed`, or a Messages `error`, is a
    STREAM_ERROR."""
    out = ParsedStream(saw_done=True)
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _fail(out, ErrorClass.MALFORMED_JSON, f"the response is not JSON: {body[:60]!r}")
    if type(obj) is not dict:
        return _fail(out, ErrorClass.MALFORMED_JSON, "the response is not a JSON object")
    if endpoint is Endpoint.RESPONSES:
        if obj.get("status") == "failed":
            return _fail(out, ErrorClass.STREAM_ERROR, _error_text(obj.get("error") or "failed"))
        items = obj.get("output")
        if type(items) is not list:
            return _fail(out, ErrorClass.MALFORMED_JSON, "the response lacks an output list")
        blocks = [
            part
            for item in items
            if type(item) is dict and item.get("type") == "message"
            for part in (item.get("content") if type(item.get("content")) is list else [])
            if type(part) is dict and part.get("type") == "output_text"
        ]
        out.finish_reason = _responses_finish(obj)
    else:
        if obj.get("type") == "error":
            return _fail(out, ErrorClass.STREAM_ERROR, _error_text(obj.get("error") or obj))
        content = obj.get("content")
        if type(content) is not list:
            return _fail(out, ErrorClass.MALFORMED_JSON, "the response lacks a content list")
        blocks = [b for b in content if type(b) is dict and b.get("type") == "text"]
        reason = obj.get("stop_reason")
        out.finish_reason = reason if type(reason) is str else None
    texts = [block.get("text") for block in blocks]
    if any(type(t) is not str for t in texts):
        return _fail(out, ErrorClass.MALFORMED_JSON, "the response's text is not a string")
    out.text = "".join(texts)
    out.usage = _usage(endpoint, obj.get("usage") if type(obj.get("usage")) is dict else {})
    out.response_id = obj["id"] if type(obj.get("id")) is str else None
    return out


def _count(usage: dict, key: str) -> int | None:
    value = usage.get(key)
    return value if type(value) is int and value >= 0 else None


def _usage(endpoint: Endpoint, raw: dict) -> dict | None:
    """The API's usage under the records' names (None: the answer said none)."""
    if not raw:
        return None
    completion = _count(raw, "output_tokens")
    prompt = _count(raw, "input_tokens")
    if endpoint is Endpoint.RESPONSES:
        details = raw.get("input_tokens_details")
        cached = _count(details, "cached_tokens") if type(details) is dict else None
    else:
        cached = _count(raw, "cache_read_input_tokens")
        created = _count(raw, "cache_creation_input_tokens")
        if prompt is not None:
            prompt += (cached or 0) + (created or 0)
    usage: dict = {}
    if prompt is not None:
        usage["prompt_tokens"] = prompt
    if completion is not None:
        usage["completion_tokens"] = completion
    if prompt is not None and completion is not None:
        usage["total_tokens"] = prompt + completion
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    if "kv_memory" in raw:
        usage["kv_memory"] = raw["kv_memory"]
    return usage or None


def _error_text(error) -> str:
    if type(error) is dict:
        return str(error.get("message") or error)[:300]
    return str(error)[:300]


def _fail(out: ParsedStream, error_class: ErrorClass, message: str) -> ParsedStream:
    out.error_class = error_class
    out.error_message = message
    return out
