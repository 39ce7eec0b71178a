"""`<think>`...`</think>` spans in streamed text, split incrementally into reasoning and answer.

Reasoning models without a server-side reasoning parser write their thinking inline, between
`<think>` and `</think>`, and a stream may cut a tag anywhere (`<th` in one event, `ink>` in the
next). `ThinkSplitter.feed` takes each piece as it comes and returns what it can already decide:
the reasoning and the answer text of that piece, tags removed; the tail that could still be the
start of the tag it waits for is held back until the next piece (or `final`) decides it.

One span per output: text before the first `<think>` is answer, text after the first `</think>`
that follows it is answer too, literal tags included. An output whose `</think>` never comes is
reasoning to its end. A `</think>` without an earlier `<think>` is answer text (some chat
templates put `<think>` in the prompt; such a server needs its own reasoning parser).

The harness (`harness.http.reasoning`) and the reference engine's `--reasoning-parser think`
(`engine_ref.serving.reasoning`) both split with this one definition.
"""

from __future__ import annotations

from enum import Enum

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


class ThinkState(Enum):
    BEFORE = "before"  # no `<think>` yet: text is answer
    INSIDE = "inside"  # after `<think>`: text is reasoning
    AFTER = "after"  # after `</think>`: text is answer


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ThinkSplitter:
    """Incremental splitter of one output's text (module doc). `opened`/`closed` say whether
    each tag has been seen; `held` is the undecided tail."""

    def __init__(self) -> None:
        self.state = ThinkState.BEFORE
        self.held = ""

    @property
    def opened(self) -> bool:
        return self.state is not ThinkState.BEFORE

    @property
    def closed(self) -> bool:
        return self.state is ThinkState.AFTER

    def feed(self, text: str, *, final: bool = False) -> tuple[str, str]:
        """The `(reasoning, answer)` text decided by this piece; with `final` nothing is held
        back (a partial tag at the very end is text of the part it stands in)."""
        buffer = self.held + text
        self.held = ""
        reasoning: list[str] = []
        answer: list[str] = []
        while buffer:
            if self.state is ThinkState.AFTER:
                answer.append(buffer)
                break
            inside = self.state is ThinkState.INSIDE
            tag = CLOSE_TAG if inside else OPEN_TAG
            out = reasoning if inside else answer
            at = buffer.find(tag)
            if at >= 0:
                out.append(buffer[:at])
                buffer = buffer[at + len(tag) :]
                self.state = ThinkState.AFTER if inside else ThinkState.INSIDE
                continue
            keep = 0 if final else _held_prefix(buffer, tag)
            out.append(buffer[: len(buffer) - keep])
            self.held = buffer[len(buffer) - keep :]
            break
        return "".join(reasoning), "".join(answer)


def split_think(text: str) -> tuple[str, str]:
    """A whole output's `(reasoning, answer)` text (module doc)."""
    return ThinkSplitter().feed(text, final=True)
