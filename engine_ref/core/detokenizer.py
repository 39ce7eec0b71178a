"""Incremental detokenisation that never splits a multi-byte UTF-8 character.

Byte-level BPE tokens can end in the middle of a character; decoding such a prefix yields
U+FFFD. Each step decodes a short window (`prefix_offset`..end) and emits only the text beyond
what the window held before (`prefix_offset`..`read_offset`), holding the new text back while
it ends in U+FFFD, i.e. until the character's remaining bytes arrive.
"""

from __future__ import annotations

from collections.abc import Callable

# Tokens of context decoded before the new ones, so leading-space and merge rules apply.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    `decode(ids) -> str` is the tokenizer's decode (special tokens skipped). `prompt_ids` give
    the context the first output token is decoded against. `add(ids)` returns the newly complete
    text; `flush()` returns whatever was held back (a final incomplete character as U+FFFD).
    """

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: list[int]) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all output text emitted so far

    def add(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        new_text = full_text[len(prefix_text) :]
        # The next window starts at the previously read tokens, so it stays short.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._trim()
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """Text held back at the end of the sequence (incomplete bytes decode as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        if len(full_text) <= len(prefix_text):
            return ""
        new_text = full_text[len(prefix_text) :]
        self.text += new_text
        return new_text

    def _trim(self) -> None:
        # Drop ids before the decode window so memory stays bounded on long outputs.
        if self._prefix_offset > 64:
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
