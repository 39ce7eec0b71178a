"""Engine counters and gauges, as one plain dataclass snapshot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding counters since start (vLLM's `spec_decode_*` metrics).

    `num_drafts`: verify steps of one sequence with at least one drafted token;
    `num_draft_tokens`: tokens drafted and verified; `num_accepted_tokens`: drafted tokens the
    target accepted (the correction or bonus token each verify step adds is not counted);
    `num_accepted_tokens_per_pos[i]`: drafts whose token i (0-based) was accepted.
    `num_steps_off_by_batch_size`: steps in which no sequence drafted because the batch was
    above `disable_by_batch_size`; `num_paused_proposals`: drafts skipped because the
    sequence's acceptance rate had fallen below the break-even rate.
    """

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]
    num_steps_off_by_batch_size: int = 0
    num_paused_proposals: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens, in [0, 1]; 0 before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted / drafts (vLLM's mean acceptance
        length); 0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(frozen=True)
class KVEvictionStats:
    """KV eviction counters since start (`engine_ref.core.kv_eviction`; 0 without it): tokens
    whose KV was evicted (a preempted sequence's again as its recompute evicts them), and
    requests that evicted any (counted at their first eviction)."""

    num_evicted_tokens: int = 0
    num_requests_evicted: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken by `LLMEngine.stats()`.

    Gauges: `num_running`, `num_waiting` sequences; KV blocks total / used / free / cached
    (cached blocks hold reusable prefix content and may also be free); `kv_cache_usage` is
    used / total in [0, 1]. Counters (since start): prefix-cache query and hit tokens (the
    prompt tokens a new request looked up when it was admitted, and those found cached: once
    per request, however many steps it waited; a preempted request's re-admission counts in
    the `preempted` pair instead, as vLLM does), preemptions, steps, prompt tokens computed
    (not served from cache) and generated tokens, split by step kind: `prefill` steps have
    only prefill rows, `decode` only decode rows, `mixed` both. Sizes: `kv_bytes_per_token` across all layers (K and V), and
    `kv_bytes_per_request` for a request of `max_model_len` tokens;
    `weight_bytes_by_kind` the bytes of weights the model holds per layer kind (embedding,
    attention, mlp, norm, lm_head; a tied output projection counts under embedding).
    `requests_shed_by_reason`: requests refused or ended early by overload control, by
    reason (`engine_ref.core.overload.SHED_REASONS`).
    """

    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_cached: int
    kv_cache_usage: float
    block_size: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_steps: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prompt_tokens_by_step_kind: dict[str, int]
    generation_tokens_by_step_kind: dict[str, int]
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    max_model_len: int
    prefix_cache_preempted_query_tokens: int = 0
    prefix_cache_preempted_hit_tokens: int = 0
    weight_bytes_by_kind: dict[str, int] | None = None
    spec_decode: SpecDecodeStats | None = None  # None: the engine runs without speculation
    requests_shed_by_reason: dict[str, int] | None = None
    kv_memory: dict[str, int] | None = None  # `KVAccounting.gauges`: the last step's figures
    kv_eviction: KVEvictionStats = KVEvictionStats()

    @property
    def kv_pool_bytes(self) -> int:
        """Bytes of every layer's KV pool (values and scales): every block's tokens."""
        return self.num_blocks_total * self.block_size * self.kv_bytes_per_token

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_query_tokens:
            return 0.0
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens
