"""Response side of the OpenAI wire protocol, shared by both endpoints: what each choice has
produced so far, logprob and usage objects, the body envelope, and SSE framing. The parts that
differ per endpoint (a choice's `text` or `message`, a chunk's `text` or `delta`) live in the
adapters of `endpoints.py`.

Pure functions and small state holders; nothing here touches the network or the engine loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's logprob with its top alternatives, texts already decoded."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice produced since its last chunk. `text_offset_chars` is where `text`
    starts within the choice's whole text; `finish_reason` is set in one delta only."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    text_offset_chars: int
    tools: Any = None  # the choice's `tools.ToolCallStream` when its output is function calls


class ChoiceAccumulator:
    """What one choice produced so far, plus what has not been streamed yet. With
    `keep_history` False (a stream, whose chunks carry everything) it keeps only counts and
    the unstreamed part, so each output costs O(1) however long the choice runs; `text`,
    `token_ids` and `logprobs` then stay empty. `tools` reads function calls out of the text
    (`engine_ref.serving.tools.ToolCallStream`; None: the text is the answer)."""

    def __init__(self, index: int, *, keep_history: bool = True, tools: Any = None) -> None:
        self.index = index
        self.keep_history = keep_history
        self.tools = tools
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.num_output_tokens = 0
        self.num_chars = 0
        self._text_parts: list[str] = []
        self._pending_text: list[str] = []
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[TokenLogprob] = []
        self._finish_sent = False

    @property
    def text(self) -> str:
        return "".join(self._text_parts)

    def add(
        self,
        new_text: str,
        new_token_ids: list[int],
        logprobs: list[TokenLogprob],
        finish_reason: str | None,
        num_output_tokens: int,
    ) -> None:
        if self.keep_history:
            self._text_parts.append(new_text)
            self.token_ids.extend(new_token_ids)
            self.logprobs.extend(logprobs)
        self.num_chars += len(new_text)
        self._pending_text.append(new_text)
        self._pending_ids.extend(new_token_ids)
        self._pending_logprobs.extend(logprobs)
        self.num_output_tokens = num_output_tokens
        if finish_reason is not None:
            self.finish_reason = finish_reason

    def has_pending(self) -> bool:
        """Whether a chunk is due: new tokens (even when their text is empty: a special token,
        or a character still incomplete and held back) or an unsent finish reason. One chunk
        per engine output keeps chunk times equal to token times, as vLLM streams them."""
        return bool(self._pending_ids) or (self.finish_reason is not None and not self._finish_sent)

    def take_pending(self) -> ChoiceDelta:
        """What is not streamed yet, marking it streamed."""
        text = "".join(self._pending_text)
        delta = ChoiceDelta(
            index=self.index,
            text=text,
            token_ids=self._pending_ids,
            logprobs=self._pending_logprobs,
            finish_reason=None if self._finish_sent else self.finish_reason,
            text_offset_chars=self.num_chars - len(text),
            tools=self.tools,
        )
        self._pending_text, self._pending_ids, self._pending_logprobs = [], [], []
        if self.finish_reason is not None:
            self._finish_sent = True
        return delta


def usage_body(
    prompt_tokens: int,
    completion_tokens: int,
    *,
    cached_tokens: int | None = None,
    kv_memory: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The `usage` object; with `cached_tokens` (prompt tokens served from the prefix cache)
    also `prompt_tokens_details`, as vLLM adds it under --enable-prompt-tokens-details; with
    `kv_memory` the engine_ref extension of that name (memory per request, docs/CONTRACTS.md)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if kv_memory is not None:
        usage["kv_memory"] = kv_memory
    return usage


def completion_logprobs_body(entries: list[TokenLogprob], text_offset_chars: int) -> dict[str, Any]:
    """The legacy completions `logprobs` object; offsets count characters from the start of
    the choice's text."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset_chars)
        text_offset_chars += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs_body(entries: list[TokenLogprob]) -> dict[str, Any]:
    """The chat `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in e.top
                ],
            }
            for e in entries
        ]
    }


def envelope(
    response_id: str,
    object_name: str,
    created_s: int,
    model: str,
    choices: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """The fields every body and chunk opens with; `extra` follows them (e.g. `usage`)."""
    return {
        "id": response_id,
        "object": object_name,
        "created": created_s,
        "model": model,
        "choices": choices,
        **extra,
    }


def sse_event(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying `body` as compact JSON."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + data.encode("utf-8") + b"\n\n"
