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
    """Prompt text and the token ids it encodes to (int64 numpy array)."""

    text: str
    token_ids: np.ndarray


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
        size = len(self.stream)
        pieces = {int(t): tokenizer.decode([int(t)]) or "" for t in np.unique(self.stream)}
        word_start_ids = [t for t, piece in pieces.items() if re.match(r" [A-Za-z]", piece)]
        self.is_word_start = np.isin(self.stream, word_start_ids)
        self.word_starts = np.flatnonzero(self.is_word_start)
        # text of the stream and the character offset of every token, when decoding token by
        # token concatenates to decoding the whole stream (byte-level BPE on ASCII text)
        piece_list = [pieces[int(t)] for t in self.stream]
        self._text = "".join(piece_list)
        self._char_at = np.zeros(size + 1, dtype=np.int64)
        np.cumsum([len(p) for p in piece_list], out=self._char_at[1:])
        self._text_sliceable = self._text == tokenizer.decode(self.stream.tolist())
        self.fast = False
        if len(self.word_starts) > 16:
            self._index_words()
            self.fast = self._check_fast_path(np.random.default_rng(0))

    def _index_words(self) -> None:
        """Per word start: the next word start (unwrapped index) and the ids and text of the
        word without its leading space (a prompt's first word)."""
        ws = self.word_starts
        size = len(self.stream)
        self._next = np.append(ws[1:], ws[0] + size)  # aligned with ws
        keys = [
            tuple(self._window(int(a), int(b - a)).tolist())
            for a, b in zip(ws, self._next, strict=True)
        ]
        unique = list(dict.fromkeys(keys))
        index = {k: i for i, k in enumerate(unique)}
        texts = [self.tokenizer.decode(list(k)).lstrip() for k in unique]
        ids = encode_many(self.tokenizer, texts)
        self._word_of = np.asarray([index[k] for k in keys], dtype=np.int64)
        self._word_ids = [np.asarray(i, dtype=np.int64) for i in ids]
        self._word_text = texts
        self._word_len = np.asarray([len(i) for i in ids], dtype=np.int64)

    # -- stream helpers -------------------------------------------------------------------

    def _window(self, start: int, length: int) -> np.ndarray:
        return np.take(self.stream, np.arange(start, start + length), mode="wrap")

    def _window_text(self, start: int, length: int) -> str:
        if not self._text_sliceable:
            return self.tokenizer.decode(self._window(start, length).tolist())
        size, total = len(self.stream), len(self._text)
        p = int(self._char_at[start % size])
        end = start % size + length
        q = (end // size) * total + int(self._char_at[end % size])
        if q <= total:
            return self._text[p:q]
        out = [self._text[p:]]
        q -= total
        while q > total:
            out.append(self._text)
            q -= total
        out.append(self._text[:q])
        return "".join(out)

    def _pick(self, lengths: np.ndarray, rng: np.random.Generator, lead: bool, tries: int = 256):
        """For each length, a word-start index k whose window ends before a word start;
        returns (k, found) arrays."""
        n = len(lengths)
        k = np.zeros(n, dtype=np.int64)
        found = np.zeros(n, dtype=bool)
        todo = np.arange(n)
        size = len(self.stream)
        for _ in range(tries):
            if len(todo) == 0:
                break
            cand = rng.integers(0, len(self.word_starts), size=len(todo))
            if lead:
                head = self._word_len[self._word_of[cand]]
                rest = self._next[cand]
            else:
                head = np.zeros(len(todo), dtype=np.int64)
                rest = self.word_starts[cand]
            body = lengths[todo] - head
            ok = (body >= 0) & self.is_word_start[(rest + np.maximum(body, 0)) % size]
            k[todo[ok]] = cand[ok]
            found[todo[ok]] = True
            todo = todo[~ok]
        return k, found

    def _assemble(self, k: int, n_tokens: int, lead: bool) -> Prompt:
        if lead:
            word = int(self._word_of[k])
            head_ids, head_text = self._word_ids[word], self._word_text[word]
            rest = int(self._next[k])
        else:
            head_ids, head_text = np.empty(0, dtype=np.int64), ""
            rest = int(self.word_starts[k])
        body = n_tokens - len(head_ids)
        ids = np.concatenate([head_ids, self._window(rest, body)])
        return Prompt(head_text + self._window_text(rest, body), ids)

    def _check_fast_path(self, rng: np.random.Generator, trials: int = 48) -> bool:
        lengths = rng.integers(1, 300, size=trials)
        for lead in (True, False):
            k, found = self._pick(lengths, rng, lead)
            for i in np.flatnonzero(found).tolist():
                p = self._assemble(int(k[i]), int(lengths[i]), lead)
                if list(self.tokenizer.encode(p.text)) != p.token_ids.tolist():
                    return False
        return True

    # -- public API -------------------------------------------------------------------------

    def prompt(self, n_tokens: int, rng: np.random.Generator, *, lead: bool = True) -> Prompt:
        """A prompt whose text encodes to exactly `n_tokens` ids (>= 1)."""
        return self.prompts([n_tokens], rng, lead=lead)[0]

    def prompts(self, lengths: Any, rng: np.random.Generator, *, lead: bool = True) -> list[Prompt]:
        """Prompts of the given token counts (>= 1). Without `lead` the text keeps its leading
        space (a continuation to append to a prefix). Verify with `verify_prompts`."""
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if len(lengths) and lengths.min() < (1 if lead else 0):
            raise WorkloadError(f"A prompt needs at least 1 token, got {int(lengths.min())}.")
        if not self.fast:
            return [self.retokenised_prompt(int(n), rng, lead=lead) for n in lengths.tolist()]
        k, found = self._pick(lengths, rng, lead)
        return [
            self._assemble(int(k[i]), n, lead)
            if found[i]
            else self.retokenised_prompt(n, rng, lead=lead)
            for i, n in enumerate(lengths.tolist())
        ]

    def continuation(self, n_tokens: int, rng: np.random.Generator) -> Prompt:
        """A word-aligned stream window that keeps its leading space, to append to a prefix or
        another block."""
        if n_tokens == 0:
            return Prompt("", np.empty(0, dtype=np.int64))
        return self.prompts([n_tokens], rng, lead=False)[0]

    def retokenised_prompt(self, n_tokens: int, rng: np.random.Generator, *, lead: bool) -> Prompt:
        """The slow path for any tokenizer: decode a stream window, re-encode, and trim or
        extend until the text encodes to exactly `n_tokens` ids; other offsets are tried
        when that fails. Raises `WorkloadError` when no offset works."""
        starts = self.word_starts if len(self.word_starts) else np.arange(len(self.stream))
        for _ in range(256):
            start = int(starts[rng.integers(len(starts))])
            text = self.tokenizer.decode(self._window(start, n_tokens).tolist())
            if lead:
                text = text.lstrip()
            ids = list(self.tokenizer.encode(text))
            if len(ids) == n_tokens:
                return Prompt(text, np.asarray(ids, dtype=np.int64))
            # repair: trim or extend the ids and re-check a few times
            for _ in range(4):
                if len(ids) > n_tokens:
                    ids = ids[:n_tokens]
                else:
                    ids = ids + self._window(start + len(ids), n_tokens - len(ids)).tolist()
                text = self.tokenizer.decode(ids)
                ids = list(self.tokenizer.encode(text))
                if len(ids) == n_tokens:
                    return Prompt(text, np.asarray(ids, dtype=np.int64))
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
    return [
        i
        for i, ids in zip(idx, encoded, strict=True)
        if not np.array_equal(np.asarray(ids, dtype=np.int64), prompts[i].token_ids)
    ]
