"""The mock's `/v1/responses` (OpenAI Responses API) and `/v1/messages` (Anthropic Messages
API), streamed as each API's typed events or answered whole (see `harness.targets.mock_server`).

The request goes through the mock's one generation handler (`MockEngine.generate`: its API key
check, which here also accepts `x-api-key`, its output bound, which here also reads
`max_output_tokens`, its fault draw and its slots); only the answer differs. Token i is written
at `ttft + i * itl` after service starts, as for chat, each token one text delta event (` t<i>`),
so a test knows the true TTFT and ITL of every request. Opening events go out at once (they
carry no token), closing events right after the last token, the terminal one last:
`response.completed` (or `response.incomplete` when the output bound ended it, which the mock's
always does) with `usage.input_tokens`/`output_tokens`, or `message_delta` (`stop_reason`
`max_tokens`, `usage.output_tokens`) then `message_stop`. Usage counts the input's
whitespace-separated words (the mock has no tokenizer); `usage=False` leaves it out.

Faults, at the middle token as for chat: `reset` aborts the connection, `incomplete` ends the
stream before the terminal event, `malformed_sse` and `malformed_json` write a line that is not
SSE or an event that is not JSON, `stall` pauses `stall_s`. `error` and `reject` are answered
by the shared handler before any event.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from harness.targets.mock_pace import TokenPace

RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
EVENT_PATHS = (RESPONSES_PATH, MESSAGES_PATH)


def add_event_routes(app: web.Application, engine) -> None:
    """Serve both APIs through `engine.generate` (a `MockEngine`)."""
    for path in EVENT_PATHS:
        app.router.add_post(path, engine.generate)


def _words(body: dict) -> int:
    """The input's whitespace-separated words: `input` (a string or messages), `system` and
    `instructions`, and `messages`' contents (strings or text parts)."""
    texts = [body.get("instructions"), body.get("system")]
    items = body.get("input")
    items = [items] if isinstance(items, str) else (items or [])
    for item in [*items, *(body.get("messages") or [])]:
        content = item.get("content") if isinstance(item, dict) else item
        parts = content if isinstance(content, list) else [content]
        texts += [p.get("text") if isinstance(p, dict) else p for p in parts]
    return sum(len(t.split()) for t in texts if isinstance(t, str))


def _frame(event: dict) -> bytes:
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class _Responses:
    """The Responses API's events and body for one request of `n_out` tokens."""

    def __init__(self, model: str, rid: str, created: int, usage: dict | None) -> None:
        self.model, self.rid, self.created = model, rid, created
        self.usage = None
        if usage is not None:
            self.usage = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }
        self.sequence = 0
        self.where = {"item_id": "msg_" + rid, "output_index": 0, "content_index": 0}

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _item(self, text: str | None) -> dict:
        parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
        status = "in_progress" if text is None else "completed"
        role = {"role": "assistant", "content": parts}
        return {"id": self.where["item_id"], "type": "message", "status": status, **role}

    def body(self, text: str | None) -> dict:
        done = text is not None
        return {
            "id": "resp_" + self.rid,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": "incomplete" if done else "in_progress",
            "incomplete_details": {"reason": "max_output_tokens"} if done else None,
            "output": [self._item(text)] if done else [],
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "usage": self.usage if done else None,
        }

    def opening(self) -> list[dict]:
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.created", response=self.body(None)),
            self._event("response.in_progress", response=self.body(None)),
            self._event("response.output_item.added", output_index=0, item=self._item(None)),
            self._event("response.content_part.added", **self.where, part=part),
        ]

    def delta(self, text: str) -> dict:
        return self._event("response.output_text.delta", **self.where, delta=text, logprobs=[])

    def closing(self, text: str) -> list[dict]:
        part = {"type": "output_text", "text": text, "annotations": []}
        return [
            self._event("response.output_text.done", **self.where, text=text, logprobs=[]),
            self._event("response.content_part.done", **self.where, part=part),
            self._event("response.output_item.done", output_index=0, item=self._item(text)),
            self._event("response.incomplete", response=self.body(text)),
        ]


class _Messages:
    """The Messages API's events and body for one request of `n_out` tokens."""

    def __init__(self, model: str, rid: str, created: int, usage: dict | None) -> None:
        self.model, self.rid = model, rid
        self.input_tokens = usage["prompt_tokens"] if usage is not None else None
        self.output_tokens = usage["completion_tokens"] if usage is not None else None

    def _message(self, text: str | None, usage: dict | None) -> dict:
        message = {
            "id": "msg_" + self.rid,
            "type": "message",
            "role": "assistant",
            "content": [] if text is None else [{"type": "text", "text": text}],
            "model": self.model,
            "stop_reason": None if text is None else "max_tokens",
            "stop_sequence": None,
        }
        return message if usage is None else {**message, "usage": usage}

    def body(self, text: str) -> dict:
        usage = None
        if self.input_tokens is not None:
            usage = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        return self._message(text, usage)

    def opening(self) -> list[dict]:
        usage = None if self.input_tokens is None else {"input_tokens": self.input_tokens}
        block = {"type": "text", "text": ""}
        return [
            {"type": "message_start", "message": self._message(None, usage)},
            {"type": "content_block_start", "index": 0, "content_block": block},
            {"type": "ping"},
        ]

    def delta(self, text: str) -> dict:
        delta = {"type": "text_delta", "text": text}
        return {"type": "content_block_delta", "index": 0, "delta": delta}

    def closing(self, text: str) -> list[dict]:
        delta = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}}
        if self.output_tokens is not None:
            delta["usage"] = {"output_tokens": self.output_tokens}
        return [{"type": "content_block_stop", "index": 0}, delta, {"type": "message_stop"}]


async def respond_events(engine, request, body, n_out, fault, start) -> web.StreamResponse:
    """Answer one request of either API (`request.path` says which) with `n_out` tokens on the
    mock's schedule from `start` (a loop time), with `fault` (None: none) at the middle token."""
    cfg = engine.config
    loop = asyncio.get_running_loop()
    ttft_s = cfg.ttft_ms / 1e3 * engine._jitter()
    words = _words(body)
    usage = None
    if cfg.usage:
        usage = {"prompt_tokens": words, "completion_tokens": n_out, "total_tokens": words + n_out}
    api = _Responses if request.path == RESPONSES_PATH else _Messages
    answer = api(cfg.model, str(engine.requests_seen), int(time.time()), usage)
    ids = {"x-request-id": f"mock-{engine.requests_seen}"}
    text = "".join(f" t{i}" for i in range(n_out))
    if not body.get("stream"):
        last_s = ttft_s + sum(cfg.itl_ms / 1e3 * engine._jitter() for _ in range(n_out - 1))
        await asyncio.sleep(max(0.0, start + last_s - loop.time()))
        engine.tokens_generated += n_out
        return web.json_response(answer.body(text), headers=ids)

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **ids})
    await response.prepare(request)
    await response.write(b"".join(_frame(e) for e in answer.opening()))
    pace = TokenPace(engine, request, response, start, ttft_s, fault, max(1, n_out // 2))
    async for i in pace.tokens(n_out, bad_json=b"event: x\ndata: {not json\n\n"):
        await response.write(_frame(answer.delta(f" t{i}")))
        engine.tokens_generated += 1
    if pace.cut:
        return response
    await response.write(b"".join(_frame(e) for e in answer.closing(text)))
    await response.write_eof()
    return response
