"""OpenAI's Responses API (`POST /v1/responses`) and Anthropic's Messages API
(`POST /v1/messages`) as two more endpoint adapters over the chat generation path.

A request is translated into the chat request it means (its input as messages, its output
bound as `max_tokens`, its sampling fields) and validated by the chat parser, so both APIs
share every limit, extension and error the chat endpoint has; fields only these APIs name are
checked here under their own names. Generation then runs as a chat request would, and the
adapter renders the result in the API's own shape: a whole `response` or `message` object, or,
streamed, the API's typed events (`event: <type>` and `data: <json>` whose `type` repeats it),
ending with the API's terminal event and no `[DONE]`:

- Responses: `response.created`, `response.in_progress`, `response.output_item.added`,
  `response.content_part.added`, `response.output_text.delta` per text delta,
  `response.output_text.done`, `response.content_part.done`, `response.output_item.done`, then
  `response.completed` (or `response.incomplete`, reason `max_output_tokens`, when the output
  bound ended it), whose `response.usage` says `input_tokens` and `output_tokens`. An engine
  failure mid-stream is `response.failed`. Every event carries its `sequence_number`.
- Messages: `message_start` (its `usage.input_tokens`), `content_block_start`, `ping`,
  `content_block_delta` (`text_delta`) per text delta, `content_block_stop`, `message_delta`
  (`stop_reason`, `usage.output_tokens`), `message_stop`; a failure mid-stream is an `error`
  event. The key may come as `x-api-key` (`middlewares.api_key_guard`).

Stop reasons: the engine's `stop` is Responses' `completed` and Messages' `end_turn`; `length`
is `incomplete` (`max_output_tokens`) and `max_tokens`; any other (`deadline`, `shed`, `abort`)
is said as the engine says it. Errors are answered in each API's error shape: Responses in
OpenAI's, Messages as `{"type": "error", "error": {"type", "message"}}`. engine_ref's
`kv_memory` usage extension rides along in both usages. Responses' `cached_tokens` is the
prefix cache's hits under `--enable-prompt-tokens-details` and 0 otherwise (as Messages'
`cache_read_input_tokens` is then absent); `cache_write_tokens` is 0: the engine does not count
the prompt tokens its prefix cache keeps.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from engine_ref.serving.endpoints import ChatEndpoint, Endpoint
from engine_ref.serving.errors import ApiError
from engine_ref.serving.fields import optional_int, shown
from engine_ref.serving.interface import ServedTokenizer
from engine_ref.serving.requests import GenerationRequest, parse_chat_request
from engine_ref.serving.responses import ChoiceAccumulator, ChoiceDelta

# Fields both APIs pass to the chat parser as they are: sampling, and engine_ref's and vLLM's
# extensions (output constraints included).
_SHARED_FIELDS = (
    "model", "temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens", "priority",
    "stop_token_ids", "cache_salt", "speculative", "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
)  # fmt: skip
_CHAT = ChatEndpoint()


class TypedEventEndpoint(Endpoint):
    """An API whose answers are typed events: requests translate to chat requests, chunks
    render as chat's internally and `sse_frames` turns that chunk stream into the API's
    events."""

    object_name = chunk_object_name = "chat.completion.chunk"  # of the internal chunks only

    def parse(
        self,
        body: dict[str, Any],
        *,
        tokenizer: ServedTokenizer,
        served_model: str,
        max_model_len: int,
        max_prompt_chars: int | None = None,
    ) -> GenerationRequest:
        return parse_chat_request(
            self.chat_body(body),
            tokenizer=tokenizer,
            served_model=served_model,
            max_model_len=max_model_len,
            max_prompt_chars=max_prompt_chars,
        )

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat request `body` means; ApiError 400 for a field of this API that is wrong."""
        raise NotImplementedError

    def choice(self, choice: ChoiceAccumulator, *, with_logprobs: bool) -> dict[str, Any]:
        return _CHAT.choice(choice, with_logprobs=False)

    def delta(self, delta: ChoiceDelta, *, with_logprobs: bool) -> dict[str, Any]:
        return _CHAT.delta(delta, with_logprobs=False)

    def opening(self, index: int) -> dict[str, Any] | None:
        return _CHAT.opening(index)

    async def sse_frames(self, bodies: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        """The API's events for the internal chunk stream `bodies`: the opening events with
        its first chunk, a text delta event per chunk with text, the closing events with the
        usage chunk (the run always asks for it), a failure event for an error body."""
        events = self.events()
        events.send(None)
        async for body in bodies:
            try:
                due = events.send(body)
            except StopIteration:  # the API's stream has ended (its failure event was sent)
                return
            for event in due:
                yield typed_event(event)

    def events(self):
        """A generator sent each internal chunk, answering with the list of events it means."""
        raise NotImplementedError


def typed_event(event: dict[str, Any]) -> bytes:
    """One server-sent event named by its `type`, carrying `event` as compact JSON."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return b"event: " + event["type"].encode() + b"\ndata: " + data.encode("utf-8") + b"\n\n"


def _text_parts(content: Any, where: str, part_types: tuple[str, ...]) -> str:
    """A message's content as one string: a string, or a list of text parts of `part_types`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(
            400, f"{where} must be a string or a list of text parts, got {shown(content)}."
        )
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") in part_types):
            raise ApiError(400, f"{where} parts must be {' or '.join(part_types)} parts.")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where} text parts need a string text.")
        texts.append(part["text"])
    return "".join(texts)


def _shared(body: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    chat.update({k: body[k] for k in _SHARED_FIELDS if k in body})
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
        # every chunk carries the usage so far: Messages opens with the prompt's tokens
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


# --- OpenAI Responses -------------------------------------------------------------------------


class ResponsesEndpoint(TypedEventEndpoint):
    """POST /v1/responses: `input` (a string, or message items) and `instructions` as the
    conversation, `max_output_tokens` as the bound; a `response` object, or its events."""

    name = "responses"
    path = "/v1/responses"
    id_prefix = "resp_"

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("previous_response_id") is not None:
            raise ApiError(
                400,
                "previous_response_id is not supported: this server stores no responses; "
                "send the whole conversation as input.",
                param="previous_response_id",
            )
        messages = []
        instructions = body.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise ApiError(400, "instructions must be a string.", param="instructions")
            messages.append({"role": "system", "content": instructions})
        messages += _responses_input(body.get("input"))
        chat = {"messages": messages, "user": body.get("user")}
        max_tokens = optional_int(body, "max_output_tokens", low=1)
        if max_tokens is not None:
            chat["max_tokens"] = max_tokens
        return _shared(body, {k: v for k, v in chat.items() if v is not None})

    def response_body(self, response_id, created_s, model, choices, usage, **_) -> dict[str, Any]:
        (choice,) = choices
        status, reason = _responses_status(choice.finish_reason)
        return _response(
            response_id, created_s, model, status, reason, choice.text, _responses_usage(usage)
        )

    def error_body(self, error: ApiError) -> dict[str, Any]:
        return error.body()

    def events(self):
        body = yield []
        response_id, created_s, model = body["id"], body["created"], body["model"]
        item_id = "msg_" + response_id.removeprefix(self.id_prefix)
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        count = iter(range(1 << 62))

        def event(kind: str, **fields: Any) -> dict[str, Any]:
            return {"type": kind, "sequence_number": next(count), **fields}

        started = _response(response_id, created_s, model, "in_progress", None, None, None)
        events = [
            event("response.created", response=started),
            event("response.in_progress", response=started),
            event("response.output_item.added", output_index=0, item=_message_item(item_id, None)),
            event("response.content_part.added", **where, part=_output_text("")),
        ]
        parts: list[str] = []
        finish = None
        while True:
            if "error" in body:
                error = {"code": "server_error", "message": body["error"].get("message", "")}
                failed = _response(response_id, created_s, model, "failed", None, None, None)
                body = yield [
                    *events,
                    event("response.failed", response={**failed, "error": error}),
                ]
                return
            for choice in body.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    parts.append(text)
                    events.append(
                        event("response.output_text.delta", **where, delta=text, logprobs=[])
                    )
                finish = choice.get("finish_reason") or finish
            if body.get("usage") is not None and not body.get("choices"):
                break  # the usage chunk: the last
            body = yield events
            events = []
        text = "".join(parts)
        status, reason = _responses_status(finish)
        done = _response(
            response_id, created_s, model, status, reason, text, _responses_usage(body["usage"])
        )
        terminal = "response.completed" if status == "completed" else "response.incomplete"
        yield [
            *events,
            event("response.output_text.done", **where, text=text, logprobs=[]),
            event("response.content_part.done", **where, part=_output_text(text)),
            event("response.output_item.done", output_index=0, item=_message_item(item_id, text)),
            event(terminal, response=done),
        ]


def _responses_input(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise ApiError(400, "input is required.", param="input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(
            400,
            f"input must be a string or a non-empty list of messages, got {shown(value)}.",
            param="input",
        )
    messages = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise ApiError(400, f"input[{i}] must be a message object.", param="input")
        types = ("input_text", "output_text", "text")
        content = _text_parts(item.get("content"), f"input[{i}].content", types)
        role = item.get("role")
        if role not in _RESPONSES_ROLES:
            raise ApiError(
                400,
                f"input[{i}].role must be one of {', '.join(_RESPONSES_ROLES)}, got {shown(role)}.",
                param="input",
            )
        messages.append({"role": role, "content": content})
    return messages


_RESPONSES_ROLES = ("user", "assistant", "system", "developer")


def _responses_status(finish_reason: str | None) -> tuple[str, str | None]:
    if finish_reason in (None, "stop"):
        return "completed", None
    return "incomplete", "max_output_tokens" if finish_reason == "length" else finish_reason


def _responses_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    mapped = {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
    if "kv_memory" in usage:
        mapped["kv_memory"] = usage["kv_memory"]
    return mapped


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _message_item(item_id: str, text: str | None) -> dict[str, Any]:
    """The output message item: in progress and empty (`text` None), or completed."""
    return {
        "id": item_id,
        "type": "message",
        "status": "in_progress" if text is None else "completed",
        "role": "assistant",
        "content": [] if text is None else [_output_text(text)],
    }


def _response(response_id, created_s, model, status, reason, text, usage) -> dict[str, Any]:
    item_id = "msg_" + response_id.removeprefix(ResponsesEndpoint.id_prefix)
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_s,
        "status": status,
        "error": None,
        "incomplete_details": None if reason is None else {"reason": reason},
        "model": model,
        "output": [] if text is None else [_message_item(item_id, text)],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "usage": usage,
    }


# --- Anthropic Messages -----------------------------------------------------------------------

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class MessagesEndpoint(TypedEventEndpoint):
    """POST /v1/messages: `system` and `messages` (user and assistant turns) as the
    conversation, `max_tokens` (required) as the bound; a `message` object, or its events."""

    name = "messages"
    path = "/v1/messages"
    id_prefix = "msg_"

    def chat_body(self, body: dict[str, Any]) -> dict[str, Any]:
        max_tokens = optional_int(body, "max_tokens", low=1)
        if max_tokens is None:
            raise ApiError(400, "max_tokens is required.", param="max_tokens")
        messages = []
        system = body.get("system")
        if system is not None:
            messages.append({"role": "system", "content": _text_parts(system, "system", ("text",))})
        turns = body.get("messages")
        if not isinstance(turns, list) or not turns:
            raise ApiError(400, "messages must be a non-empty list.", param="messages")
        for i, turn in enumerate(turns):
            role = turn.get("role") if isinstance(turn, dict) else None
            if role not in ("user", "assistant"):
                raise ApiError(
                    400,
                    f"messages[{i}].role must be user or assistant, got {shown(role)}.",
                    param="messages",
                )
            content = _text_parts(turn.get("content"), f"messages[{i}].content", ("text",))
            messages.append({"role": role, "content": content})
        chat = {"messages": messages, "max_tokens": max_tokens}
        stop = body.get("stop_sequences")
        if stop is not None:
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
                raise ApiError(
                    400, "stop_sequences must be a list of non-empty strings.", param="stop"
                )
            chat["stop"] = stop
        metadata = body.get("metadata")
        if metadata is not None:
            if not isinstance(metadata, dict):
                raise ApiError(400, "metadata must be an object.", param="metadata")
            chat["user"] = metadata.get("user_id")
        return _shared(body, chat)

    def response_body(self, response_id, created_s, model, choices, usage, **_) -> dict[str, Any]:
        (choice,) = choices
        return {
            **_message(
                response_id, model, _stop_reason(choice.finish_reason), _anthropic_usage(usage)
            ),
            "content": [{"type": "text", "text": choice.text}],
        }

    def error_body(self, error: ApiError) -> dict[str, Any]:
        kind = _ANTHROPIC_ERROR_TYPES.get(error.status)
        if kind is None:
            kind = "invalid_request_error" if error.status < 500 else "api_error"
        return {"type": "error", "error": {"type": kind, "message": error.message}}

    def events(self):
        body = yield []
        usage = body.get("usage") or {}
        start_usage = {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": 0}
        events = [
            {
                "type": "message_start",
                "message": _message(body["id"], body["model"], None, start_usage),
            },
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            {"type": "ping"},
        ]
        finish = None
        while True:
            if "error" in body:
                error = {"type": "api_error", "message": body["error"].get("message", "")}
                body = yield [*events, {"type": "error", "error": error}]
                return
            for choice in body.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    delta = {"type": "text_delta", "text": text}
                    events.append({"type": "content_block_delta", "index": 0, "delta": delta})
                finish = choice.get("finish_reason") or finish
            if body.get("usage") is not None and not body.get("choices"):
                break
            body = yield events
            events = []
        final = _anthropic_usage(body["usage"])
        delta = {"stop_reason": _stop_reason(finish), "stop_sequence": None}
        yield [
            *events,
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": delta, "usage": final},
            {"type": "message_stop"},
        ]


def _stop_reason(finish_reason: str | None) -> str | None:
    return {"stop": "end_turn", "length": "max_tokens"}.get(finish_reason, finish_reason)


def _anthropic_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the cache apart from `input_tokens`."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    mapped = {
        "input_tokens": usage["prompt_tokens"] - (cached or 0),
        "output_tokens": usage["completion_tokens"],
    }
    if cached is not None:
        mapped["cache_read_input_tokens"] = cached
    if "kv_memory" in usage:
        mapped["kv_memory"] = usage["kv_memory"]
    return mapped


def _message(message_id, model, stop_reason, usage) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage,
    }


EVENT_ENDPOINTS = (ResponsesEndpoint(), MessagesEndpoint())
