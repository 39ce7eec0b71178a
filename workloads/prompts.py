"""Token-exact prompt synthesis from a bundled English corpus.

The corpus (`data/corpus.txt`, original prose) is split into sentences; each sentence is
tokenised once (with a leading space) and a fixed set of seeded sentence permutations is
concatenated into a cyclic token stream. A prompt of N tokens is a window of that stream that
starts at a word (its leading space dropped) and ends before the next word, so its text reads as
natural English and re-tokenises to exactly the same N ids.

Fast path: for tokenizers that split text into words before merging (byte-level BPE such as
GPT-2, Llama 3 or SmolLM2), a word-aligned window re-tokenises to itself, so prompts are cut
from the stream with numpy and never re-encoded one by one. The synthesizer checks that property
on random windows when it is built, and every build verifies prompts by re-encoding them
(all of them up to `full_check_tokens` tokens in total, else a seeded sample; any failure in the
sample triggers a full check and repair). Tokenizers without the property (e.g. SentencePiece)
take the slow path: decode, re-encode, retry at another offset until the count is exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

import numpy as np

from workloads.schema import WorkloadError

STREAM_PERMUTATIONS = 8
_STREAM_SEED = 20231116


class TokenizerLike(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def corpus_text() -> str:
    """The bundled corpus (about 8 KB of original English prose)."""
    return resources.files("workloads.data").joinpath("corpus.txt").read_text(encoding="utf-8")


def encode_many(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """`encode` over many texts, through the tokenizer's `encode_batch` when it has one."""
    batch = getattr(tokenizer, "encode_batch", None)
    if callable(batch) and texts:
        return [list(ids) for ids in batch(texts)]
    return [list(tokenizer.encode(t)) for t in texts]


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: list[int]


class PromptSynthesizer:
    """Builds prompts of exact token counts for one tokenizer (see the module docstring).

    All randomness comes from the `numpy.random.Generator` passed to each method.
    """

    def __init__(self, tokenizer: Any, *, text: str | None = None) -> None:
        self.tokenizer = tokenizer
        sentences = [
            s.strip() for s in re.split(r"(?<=[.!?])\s+", text or corpus_text()) if s.strip()
        ]
        if len(sentences) < 2:
            raise WorkloadError("The prompt corpus needs at least two sentences.")
        sentence_ids = encode_many(tokenizer, [" " + s for s in sentences])
        order_rng = np.random.default_rng(_STREAM_SEED)
        parts: list[list[int]] = []
        for _ in range(STREAM_PERMUTATIONS):
            parts.extend(sentence_ids[i] for i in order_rng.permutation(len(sentences)))
        self.stream = np.asarray([t for p in parts for t in p], dtype=np.int64)
        unique = np.unique(self.stream)
        word_start_ids = {
            int(t) for t in unique if re.match(r" [A-Za-z]", tokenizer.decode([int(t)]) or "")
        }
        self.is_word_start = np.isin(self.stream, list(word_start_ids))
        self.word_starts = np.flatnonzero(self.is_word_start)
        self._first_word: dict[int, list[int]] = {}
        self.fast = len(self.word_starts) > 16 and self._check_fast_path(np.random.default_rng(0))

    # -- stream helpers -------------------------------------------------------------------

    def _window(self, start: int, length: int) -> np.ndarray:
        return np.take(self.stream, np.arange(start, start + length), mode="wrap")

    def _next_word_start(self, pos: int) -> int:
        """Index (unwrapped) of the first word start strictly after `pos`."""
        n = len(self.stream)
        k = np.searchsorted(self.word_starts, (pos % n) + 1)
        if k < len(self.word_starts):
            return pos - pos % n + int(self.word_starts[k])
        return pos - pos % n + n + int(self.word_starts[0])

    def _first_word_ids(self, start: int) -> tuple[list[int], int]:
        """Ids of the first word at word start `start` without its leading space, and the
        stream index where the rest of the window continues."""
        nxt = self._next_word_start(start)
        key = start % len(self.stream)
        if key not in self._first_word:
            word = self.tokenizer.decode(self._window(start, nxt - start).tolist()).lstrip()
            self._first_word[key] = list(self.tokenizer.encode(word))
        return self._first_word[key], nxt

    def _check_fast_path(self, rng: np.random.Generator, trials: int = 48) -> bool:
        for _ in range(trials):
            ids = self._fast_prompt_ids(int(rng.integers(4, 200)), rng, lead=bool(rng.integers(2)))
            if ids is None or list(self.tokenizer.encode(self.tokenizer.decode(ids))) != ids:
                return False
        return True

    def _word_end_ok(self, end: int) -> bool:
        return bool(self.is_word_start[end % len(self.stream)])

    def _fast_prompt_ids(
        self, n_tokens: int, rng: np.random.Generator, *, lead: bool = True, tries: int = 256
    ) -> list[int] | None:
        """A word-aligned window of exactly `n_tokens` ids. `lead` drops the first word's leading
        space (a prompt start); without it the window keeps it (a continuation)."""
        for _ in range(tries):
            start = int(self.word_starts[rng.integers(len(self.word_starts))])
            if lead:
                head, rest = self._first_word_ids(start)
            else:
                head, rest = [], start
            body_len = n_tokens - len(head)
            if body_len < 0 or not self._word_end_ok(rest + body_len):
                continue
            return head + self._window(rest, body_len).tolist()
        return None

    # -- public API -------------------------------------------------------------------------

    def prompt(self, n_tokens: int, rng: np.random.Generator, *, lead: bool = True) -> Prompt:
        """A prompt whose text encodes to exactly `n_tokens` ids (>= 1)."""
        return self.prompts([n_tokens], rng, lead=lead)[0]

    def prompts(self, lengths: Any, rng: np.random.Generator, *, lead: bool = True) -> list[Prompt]:
        """Prompts of the given token counts (not yet verified; see `verify`)."""
        out: list[Prompt] = []
        for n in np.asarray(lengths, dtype=np.int64).tolist():
            if n < 1:
                raise WorkloadError(f"A prompt needs at least 1 token, got {n}.")
            ids = self._fast_prompt_ids(n, rng, lead=lead) if self.fast else None
            if ids is None:
                out.append(self._slow_prompt(n, rng, lead=lead))
            else:
                out.append(Prompt(self.tokenizer.decode(ids), ids))
        return out

    def continuation(self, n_tokens: int, rng: np.random.Generator) -> list[int]:
        """Ids of a word-aligned stream window that keeps its leading space, for appending to a
        prefix or another block (slow path: any window starting at a word)."""
        if n_tokens == 0:
            return []
        if self.fast:
            ids = self._fast_prompt_ids(n_tokens, rng, lead=False)
            if ids is not None:
                return ids
        start = (
            int(self.word_starts[rng.integers(len(self.word_starts))])
            if len(self.word_starts)
            else 0
        )
        return self._window(start, n_tokens).tolist()

    def _slow_prompt(self, n_tokens: int, rng: np.random.Generator, *, lead: bool) -> Prompt:
        starts = self.word_starts if len(self.word_starts) else np.arange(len(self.stream))
        for _ in range(256):
            start = int(starts[rng.integers(len(starts))])
            text = self.tokenizer.decode(self._window(start, n_tokens).tolist())
            if lead:
                text = text.lstrip()
            ids = list(self.tokenizer.encode(text))
            if len(ids) == n_tokens:
                return Prompt(text, ids)
            # repair: trim or extend the ids and re-check a few times
            for _ in range(4):
                if len(ids) > n_tokens:
                    ids = ids[:n_tokens]
                else:
                    ids = ids + self._window(start + len(ids), n_tokens - len(ids)).tolist()
                text = self.tokenizer.decode(ids)
                ids = list(self.tokenizer.encode(text))
                if len(ids) == n_tokens:
                    return Prompt(text, ids)
        name = getattr(self.tokenizer, "name", "the tokenizer")
        raise WorkloadError(
            f"Could not synthesise a prompt of exactly {n_tokens} tokens for {name}."
        )


def verify_prompts(
    tokenizer: Any, prompts: list[Prompt], *, indices: list[int] | None = None
) -> list[int]:
    """Indices (among `indices`, default all) whose text does not encode to their token ids."""
    idx = list(range(len(prompts))) if indices is None else indices
    encoded = encode_many(tokenizer, [prompts[i].text for i in idx])
    return [i for i, ids in zip(idx, encoded, strict=True) if ids != prompts[i].token_ids]
