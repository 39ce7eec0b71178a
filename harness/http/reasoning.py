"""Reasoning and answer, told apart event by event in a parsed stream.

Servers say a reasoning model's thinking in one of two ways. With a reasoning parser (vLLM,
SGLang, DeepSeek's API) each chat delta carries it in its own key: `reasoning_content` (vLLM up
to 0.10, SGLang, DeepSeek) or `reasoning` (vLLM 0.11 on, which for a while sent both with the
same text: one is read, never both). Without one, the model's `<think>`...`</think>` span stays
inline in `content` (or a completion's `text`), its tags possibly cut across events; the spans
are split with `bench_common.think_tags` (one span per output, as documented there).

Every event gets a `Part`: `REASONING` when it carries reasoning text only, or no text but the
reasoning key as a string (the reference engine sends `"reasoning_content": ""` for a token
whose text is a tag or held back inside the span), or only tags and held-back text while the
span is open, or was still opening; `ANSWER` when it carries answer text only; `BOTH` when it
carries both (counted as answer; its reasoning text still makes it a reasoning event for the
time to the first reasoning token). An event with no text at all (a role chunk, a finish or
usage chunk) takes the part of the event before it, `ANSWER` at the start. The answer text is
what output checks see; the reasoning text is kept apart.

Streams without either form cost one substring test over the joined text.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from bench_common.think_tags import OPEN_TAG, ThinkSplitter, ThinkState, split_think

REASONING_KEYS = ("reasoning_content", "reasoning")


class Part(IntEnum):
    """What one event's tokens are (the `reasoning` marker of its chunk)."""

    ANSWER = 0
    REASONING = 1
    BOTH = 2  # reasoning and answer text in one event; its tokens count as answer


def delta_reasoning(delta: object) -> str | None:
    """The reasoning text a chat delta (or message) carries: `reasoning_content`, else
    `reasoning`; "" when a key holds an empty string; None when neither holds a string."""
    if type(delta) is not dict:
        return None
    found = None
    for key in REASONING_KEYS:
        value = delta.get(key)
        if type(value) is str:
            if value:
                return value
            found = ""
    return found


@dataclass(frozen=True, slots=True)
class EventSplit:
    """A stream's events split: `part` one `Part` per event (int8), the answer and the
    reasoning text each joined in order."""

    part: np.ndarray
    answer: str
    reasoning: str


def split_parts(contents: list[str | None], thoughts: list[str | None]) -> EventSplit:
    """Split per-event `contents` (a delta's `content` or a completion's `text`; None: none)
    and `thoughts` (`delta_reasoning` of each event) into parts (module doc)."""
    n = len(contents)
    joined = "".join(c for c in contents if c)
    if OPEN_TAG not in joined and all(t is None for t in thoughts):
        return EventSplit(np.zeros(n, np.int8), joined, "")
    splitter = ThinkSplitter() if OPEN_TAG in joined else None
    part = np.zeros(n, np.int8)
    answer: list[str] = []
    reasoning: list[str] = []
    previous = Part.ANSWER
    for i, (content, thought) in enumerate(zip(contents, thoughts, strict=True)):
        thought_text = thought or ""
        answer_text = content or ""
        opening = False
        if splitter is not None and content:
            before = splitter.state
            thought_more, answer_text = splitter.feed(content)
            thought_text += thought_more
            # tags or held-back text only: the span is open, closed just now, or opening
            opening = (
                splitter.state is ThinkState.INSIDE
                or (before is not ThinkState.AFTER and splitter.closed)
                or bool(splitter.held)
            )
        reasoning.append(thought_text)
        answer.append(answer_text)
        if thought_text and answer_text:
            here = Part.BOTH
        elif thought_text:
            here = Part.REASONING
        elif answer_text:
            here = Part.ANSWER
        elif (thought is not None and not content) or opening:
            here = Part.REASONING
        else:
            here = previous
        part[i] = here
        previous = Part.ANSWER if here is Part.BOTH else here
    if splitter is not None and splitter.held:  # the stream ended inside a possible tag
        thought_tail, answer_tail = splitter.feed("", final=True)
        reasoning.append(thought_tail)
        answer.append(answer_tail)
    return EventSplit(part, "".join(answer), "".join(reasoning))


def split_message(content: str | None, message: object) -> tuple[str, str]:
    """A whole (non-streamed) answer's `(answer, reasoning)` text: the message's reasoning
    key, plus any `<think>` span inside its content."""
    content = content or ""
    thought = delta_reasoning(message) or ""
    if OPEN_TAG in content:
        more, content = split_think(content)
        thought += more
    return content, thought
