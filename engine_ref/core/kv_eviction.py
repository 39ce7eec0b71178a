"""Lossy KV eviction, StreamingLLM style, only when asked (`EngineConfig.kv_eviction`).

"none", the default, keeps every computed token's KV: the engine is exact. "sliding-window"
keeps only the blocks covering a sequence's most recent `kv_window_tokens` tokens. "sinks" also
keeps its first ceil(`kv_sink_tokens` / block_size) blocks: the "attention sinks" of
StreamingLLM (Xiao et al., 2023), initial tokens a model puts much of its attention on whatever
they say, without which window attention falls apart once the first tokens leave the window.
The defaults are StreamingLLM's: 4 sink tokens (the paper finds four enough to restore
perplexity), and a recent window of 1,024 tokens, inside the range of cache sizes it evaluates;
a sliding-window model (Mistral) served by vLLM would set the model's own window instead.

Granularity and timing. Eviction frees whole blocks, between steps: at the start of every
scheduler iteration, before the step's slots are allocated, each running sequence with C
computed tokens drops the blocks after its sinks whose every token lies before its window
(positions < C - window), through the block manager's deferred-free path (`BlockManager.evict`),
so a step in flight never loses a block it reads. A block is out of the window only once all of
its tokens are, so a decode row sees the sinks and between `window` and `window + bs - 1` recent
tokens. A prefill chunk is scheduled as without eviction, so its rows also see the chunk's
earlier rows, and a long prompt is evicted between its chunks: a sequence holds at most
`sink_blocks + ceil((window + n - 1) / bs) + 1` blocks in a step that computes n of its tokens
(n is bounded by `max_num_batched_tokens`). A prefix-cache hit is served whole: its blocks out of the
window are evicted before the sequence's next step, so its first step sees them (they are
exact). Preemption frees everything; the recompute evicts again as it goes.

Addressing. The block table holds the kept blocks only: the sink blocks, then the blocks from
the first one still in the window. `Sequence.kv_evicted_tokens` (a multiple of bs) counts the
tokens dropped after the sinks, so the token at text position p lives at table index p // bs in
a sink block and p // bs - kv_evicted_tokens // bs otherwise, and its "kept position", its place
in the kept blocks laid end to end, is p - kv_evicted_tokens. Attention metadata is built over
kept positions (`ModelRunner.forward`): slot mapping, context lengths and a chunk's causal
offsets then need nothing else.

Positions. RoPE positions stay the text positions: keys are stored already rotated at their
text position. StreamingLLM instead re-assigns positions inside the cache (keys cached before
rotation and rotated by their cache slot at every step), so no position passes the window; that
costs a re-rotation of every kept key per step, or an unrotated pool and RoPE inside each
attention kernel. Here the distances a query sees are the true ones, the kernels are unchanged,
and a sequence stays within `max_model_len` (the model's positions and the pool) as before.

Exact reuse kept apart. A block computed after a sequence's first eviction depends on a lossy
context, so it is never entered in the prefix cache; blocks computed before it are exact and are
(`BlockManager.register_full_blocks`). Evicted blocks that were cached stay cached (LRU), like
any freed block. Lossy requests are flagged: `RequestOutput.kv_evicted_tokens`, and `/metrics`
counts evicted tokens and requests that evicted.

Refused: speculative decoding, whose rollback (`BlockManager.trim`) and token-tree KV moves
address a sequence's KV by text position.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

# Structural types, so this module imports nothing of the core (engine_config imports it).


class EvictionSettings(Protocol):
    """The `EngineConfig` fields eviction reads."""

    @property
    def kv_eviction(self) -> str: ...
    @property
    def kv_window_tokens(self) -> int: ...
    @property
    def kv_sink_tokens(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def speculative_config(self) -> Any: ...


class BlockEvictor(Protocol):
    """What eviction calls on the block manager (`BlockManager.evict`)."""

    def evict(self, seq: Any, first: int, count: int) -> None: ...


KV_EVICTION_MODES = ("none", "sliding-window", "sinks")


def check_kv_eviction(config: EvictionSettings) -> str | None:
    """One sentence naming what is wrong with `config`'s eviction settings, or None."""
    mode = config.kv_eviction
    if mode not in KV_EVICTION_MODES:
        return f"Unknown kv_eviction {mode!r}; use one of {', '.join(KV_EVICTION_MODES)}."
    for name, low in (("kv_window_tokens", 1), ("kv_sink_tokens", 0)):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            return f"{name} must be an integer of at least {low}, got {value!r}."
    if mode != "none" and config.speculative_config is not None:
        return (
            f"kv_eviction {mode} cannot be combined with speculative decoding (its rollback "
            "addresses KV by text position); drop one of the two."
        )
    return None


@dataclass(frozen=True)
class KVEviction:
    """An engine's eviction rule (None from `of` when `kv_eviction` is "none")."""

    window_tokens: int
    num_sink_blocks: int
    block_size: int

    @classmethod
    def of(cls, config: EvictionSettings) -> KVEviction | None:
        if config.kv_eviction == "none":
            return None
        bs = config.block_size
        sinks = -(-config.kv_sink_tokens // bs) if config.kv_eviction == "sinks" else 0
        return cls(int(config.kv_window_tokens), sinks, bs)

    def blocks_out_of_window(self, num_computed_tokens: int) -> int:
        """Blocks after the sinks whose every token lies before the window of a sequence with
        `num_computed_tokens` computed: what it has evicted once `apply` has run."""
        before_window = (num_computed_tokens - self.window_tokens) // self.block_size
        return max(0, before_window - self.num_sink_blocks)

    def apply(self, seqs: Iterable[Any], block_manager: BlockEvictor) -> None:
        """Evict what has left each sequence's (`core.sequence.Sequence`) window since it last
        ran (between steps)."""
        for seq in seqs:
            evicted_blocks = seq.kv_evicted_tokens // self.block_size
            due = self.blocks_out_of_window(seq.num_computed_tokens) - evicted_blocks
            if due > 0:
                block_manager.evict(seq, self.num_sink_blocks, due)
