"""`--reasoning-parser think`: a reasoning model's `<think>` span streamed apart from its answer.

With the parser on, the chat endpoint splits each choice's output text with
`bench_common.think_tags` (one span: text between the first `<think>` and the `</think>` after
it is reasoning, the rest answer; the tags are in neither; a tag cut across tokens is held back
until the next token decides it). A stream carries the reasoning in `delta.reasoning_content`
and the answer in `delta.content`, as vLLM and SGLang do; a whole answer in
`message.reasoning_content` (null: none) and `message.content`. A chunk whose tokens belong to
the reasoning but show no text yet (a tag, a held-back part of one) carries
`"reasoning_content": ""`, so a client counting chunks knows which part its tokens are.

Usage gains `completion_tokens_details.reasoning_tokens`: the tokens up to and including the
engine output that completed `</think>` (every token when the span never closes, 0 when it
never opens); text before `<think>` is answer text, yet its tokens count here (vLLM's parsers
assume the output starts with the span). One engine output is one token except under
speculative decoding, where the closing output's accepted tokens all count.

The completions endpoint is unchanged: its `text` is the raw output, tags and all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bench_common.think_tags import ThinkSplitter, ThinkState
from engine_ref.serving.endpoints import ChatEndpoint, Endpoint
from engine_ref.serving.responses import ChoiceAccumulator, ChoiceDelta, TokenLogprob

REASONING_PARSERS = ("think",)
REASONING_KEY = "reasoning_content"


@dataclass(frozen=True)
class ReasoningDelta(ChoiceDelta):
    """A chat delta split: `text` the answer part, `reasoning` the reasoning part;
    `in_reasoning` says the delta's tokens belong to the reasoning (module doc)."""

    reasoning: str = ""
    in_reasoning: bool = False


class ReasoningChoice(ChoiceAccumulator):
    """A choice whose text is split as it arrives; `text` is the answer, `reasoning_text` the
    reasoning (both kept only with `keep_history`), `reasoning_tokens` the usage count."""

    def __init__(self, index: int, **options: Any) -> None:
        super().__init__(index, **options)
        self.splitter = ThinkSplitter()
        self._answer: list[str] = []
        self._reasoning: list[str] = []
        self._pending_answer: list[str] = []
        self._pending_reasoning: list[str] = []
        self._pending_in_reasoning = False
        self._closed_at: int | None = None  # tokens when `</think>` completed

    @property
    def text(self) -> str:
        return "".join(self._answer)

    @property
    def reasoning_text(self) -> str:
        return "".join(self._reasoning)

    @property
    def reasoning_tokens(self) -> int:
        if self._closed_at is not None:
            return self._closed_at
        opened = self.splitter.opened or bool(self.splitter.held)
        return self.num_output_tokens if opened else 0

    def add(
        self,
        new_text: str,
        new_token_ids: list[int],
        logprobs: list[TokenLogprob],
        finish_reason: str | None,
        num_output_tokens: int,
    ) -> None:
        super().add(new_text, new_token_ids, logprobs, finish_reason, num_output_tokens)
        was_closed = self.splitter.closed
        reasoning, answer = self.splitter.feed(new_text, final=finish_reason is not None)
        if self.splitter.closed and not was_closed:
            self._closed_at = num_output_tokens
        state = self.splitter.state
        held_opening = state is ThinkState.BEFORE and bool(self.splitter.held)
        if state is ThinkState.INSIDE or (self.splitter.closed and not was_closed) or held_opening:
            self._pending_in_reasoning = True
        if self.keep_history:
            self._answer.append(answer)
            self._reasoning.append(reasoning)
        self._pending_answer.append(answer)
        self._pending_reasoning.append(reasoning)

    def take_pending(self) -> ReasoningDelta:
        raw = super().take_pending()
        values = {f.name: getattr(raw, f.name) for f in dataclasses.fields(raw)}
        values["text"] = "".join(self._pending_answer)
        delta = ReasoningDelta(
            **values,
            reasoning="".join(self._pending_reasoning),
            in_reasoning=self._pending_in_reasoning,
        )
        self._pending_answer, self._pending_reasoning = [], []
        self._pending_in_reasoning = False
        return delta


class ReasoningChatEndpoint(ChatEndpoint):
    """The chat endpoint with `--reasoning-parser think` (module doc)."""

    def new_choice(self, index: int, **options: Any) -> ChoiceAccumulator:
        return ReasoningChoice(index, **options)

    def choice(self, choice: ChoiceAccumulator, *, with_logprobs: bool) -> dict[str, Any]:
        item = super().choice(choice, with_logprobs=with_logprobs)
        if isinstance(choice, ReasoningChoice):
            item["message"][REASONING_KEY] = choice.reasoning_text or None
        return item

    def delta(self, delta: ChoiceDelta, *, with_logprobs: bool) -> dict[str, Any]:
        item = super().delta(delta, with_logprobs=with_logprobs)
        if not isinstance(delta, ReasoningDelta):
            return item
        body = item["delta"]
        if delta.reasoning or (delta.in_reasoning and not delta.text):
            if body.get("content") == "":
                del body["content"]
            body[REASONING_KEY] = delta.reasoning
        return item

    def usage_details(self, usage: dict[str, Any], choices: list) -> dict[str, Any]:
        reasoning = sum(c.reasoning_tokens for c in choices if isinstance(c, ReasoningChoice))
        return {**usage, "completion_tokens_details": {"reasoning_tokens": reasoning}}


def with_reasoning(endpoint: Endpoint, parser: str | None) -> Endpoint:
    """`endpoint` as `parser` has it serve: the chat endpoint split (module doc) when a parser
    is set; every other endpoint, and chat without a parser, as it is."""
    if parser is None or type(endpoint) is not ChatEndpoint:
        return endpoint
    if parser not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}"
        )
    return ReasoningChatEndpoint()
