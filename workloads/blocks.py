"""Token blocks for Mooncake-style traces, where a prompt is a chain of hash ids, one per
512-token block, and the infinite-cache block reuse such a trace implies.

Distinct ids give distinct blocks by construction: every block starts with a tag that spells the
id's index (its order of first appearance) in base D with D single-token words of the corpus
(" a", " the", ... for byte-level BPE), `tag_len` words long; a prompt's first block puts one
fixed word before the tag so it reads as text. The rest of a block is a word-aligned window of
the corpus stream. A block's content depends only on (id, its length, whether it starts the
prompt), so requests sharing an id share those tokens exactly, and two full blocks with different
ids differ in their tags. Only a window start is kept per block, never its tokens, so memory
stays bounded by the number of distinct blocks, not by the prompt tokens.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

import numpy as np

from workloads.loaders import MOONCAKE_BLOCK_TOKENS
from workloads.prompts import Prompt, PromptSynthesizer
from workloads.schema import WorkloadError


def block_reuse_from_ids(hash_ids: Iterable[Sequence[int]], input_lengths: Iterable[int]) -> int:
    """Full 512-token blocks an infinite prefix cache would serve, from the trace's ids: block
    k of a request is a hit when an earlier request had the same ids for blocks 0..k (the
    chained key a prefix cache uses). Partial last blocks are never cached. Order matters:
    requests are taken in the order given."""
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for ids, n_in in zip(hash_ids, input_lengths, strict=True):
        for k in range(int(n_in) // MOONCAKE_BLOCK_TOKENS):
            key = tuple(ids[: k + 1])
            hits += key in seen
            seen.add(key)
    return hits


def block_reuse_from_tokens(token_ids: Iterable[Sequence[int]]) -> int:
    """The same count from the prompts' token ids: block k is a hit when an earlier prompt had
    the same first (k + 1) * 512 tokens (a chained sha256 over the blocks' bytes)."""
    seen: set[bytes] = set()
    hits = 0
    for ids in token_ids:
        ids = np.asarray(ids, dtype=np.int64)
        chain = hashlib.sha256()
        for k in range(len(ids) // MOONCAKE_BLOCK_TOKENS):
            chain.update(ids[k * MOONCAKE_BLOCK_TOKENS : (k + 1) * MOONCAKE_BLOCK_TOKENS].tobytes())
            key = chain.copy().digest()
            hits += key in seen
            seen.add(key)
    return hits


class BlockSynthesizer:
    """Prompts built block by block from hash ids (see the module docstring).

    `num_ids` bounds the distinct ids it will be asked for (it sizes the tag). Randomness (the
    window of each new block) comes from the generator passed to `prompts`.
    """

    def __init__(self, synth: PromptSynthesizer, num_ids: int) -> None:
        if not hasattr(synth, "_next"):
            raise WorkloadError(
                f"The prompt corpus has too few words for {getattr(synth.tokenizer, 'name', 'this tokenizer')} "
                "to build trace blocks."
            )
        self.synth = synth
        ws, nxt = synth.word_starts, synth._next
        words = np.unique(synth.stream[ws[(nxt - ws) == 1]])  # " word" tokens, whole words
        if len(words) < 2:
            raise WorkloadError(
                f"The corpus has fewer than two one-token words for "
                f"{getattr(synth.tokenizer, 'name', 'this tokenizer')}; trace blocks need them."
            )
        self.digits = words.astype(np.int64)
        self.digit_text = [synth.tokenizer.decode([int(t)]) for t in self.digits]
        self.tag_len = max(1, math.ceil(math.log(max(num_ids, 2)) / math.log(len(self.digits))))
        # the fixed first word of every prompt: the shortest lead-form word of the corpus
        lead = int(np.argmin(synth._word_len))
        self.head_ids = synth._word_ids[lead]
        self.head_text = synth._word_text[lead]
        self._index: dict[int, int] = {}
        self._window: dict[tuple[int, int, bool], int] = {}
        self.num_ids = num_ids

    @property
    def num_blocks(self) -> int:
        """Distinct (id, length, lead) blocks built so far."""
        return len(self._window)

    def _tag(self, h: int) -> np.ndarray:
        index = self._index.setdefault(h, len(self._index))
        if index >= len(self.digits) ** self.tag_len:
            raise WorkloadError(f"More distinct hash ids than the {self.num_ids} announced.")
        out = np.empty(self.tag_len, dtype=np.int64)
        for p in range(self.tag_len - 1, -1, -1):
            index, out[p] = divmod(index, len(self.digits))
        return out

    def _prepare(self, keys: list[tuple[int, int, bool]], rng: np.random.Generator) -> None:
        """Choose a window start for every block in `keys` not built yet, in one vectorised
        pick; -1 marks a block with no word-aligned window (built on the slow path)."""
        new = [key for key in dict.fromkeys(keys) if key not in self._window]
        bodies = np.asarray([self._body(size, lead) for _, size, lead in new], dtype=np.int64)
        if not new:
            return
        k, found = self.synth._pick(np.maximum(bodies, 0), rng, lead=False)
        starts = np.where(found & (bodies > 0), self.synth.word_starts[k], -1)
        for key, start in zip(new, starts.tolist(), strict=True):
            self._index.setdefault(key[0], len(self._index))
            self._window[key] = start

    def _body(self, size: int, lead: bool) -> int:
        return size - self.tag_len - (len(self.head_ids) if lead else 0)

    def _block(self, key: tuple[int, int, bool]) -> Prompt:
        h, size, lead = key
        tag = self._tag(h)
        head = self.head_ids if lead else np.empty(0, dtype=np.int64)
        fixed = np.concatenate([head, self.digits[tag]])
        if size <= len(fixed):  # a short last block: its first tokens only
            ids = fixed[:size]
            return Prompt(self.synth.tokenizer.decode(ids.tolist()), ids)
        body = size - len(fixed)
        text = (self.head_text if lead else "") + "".join(self.digit_text[i] for i in tag)
        start = self._window[key]
        if start < 0:  # no word-aligned window of this length: the slow path, verified later
            tail = self.synth.retokenised_prompt(body, np.random.default_rng(h), lead=False)
            return Prompt(text + tail.text, np.concatenate([fixed, tail.token_ids]))
        ids = np.concatenate([fixed, self.synth._window(start, body)])
        return Prompt(text + self.synth._window_text(start, body), ids)

    def prompts(
        self,
        input_lengths: Sequence[int],
        hash_ids: Sequence[Sequence[int]],
        rng: np.random.Generator,
    ) -> list[Prompt]:
        """Prompts of `input_lengths[i]` tokens whose block k is the content of
        `hash_ids[i][k]` (512 tokens; the last block holds the remainder)."""
        keyed = []
        for n_in, ids in zip(input_lengths, hash_ids, strict=True):
            keyed.append(
                [
                    (
                        int(h),
                        min(MOONCAKE_BLOCK_TOKENS, int(n_in) - k * MOONCAKE_BLOCK_TOKENS),
                        k == 0,
                    )
                    for k, h in enumerate(ids)
                ]
            )
        self._prepare([key for keys in keyed for key in keys], rng)
        out = []
        for keys in keyed:
            blocks = [self._block(key) for key in keys]
            out.append(
                Prompt(
                    "".join(b.text for b in blocks), np.concatenate([b.token_ids for b in blocks])
                )
            )
        return out
