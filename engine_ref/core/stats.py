"""Engine counters and gauges, as one plain dataclass snapshot."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_query_tokens:
            return 0.0
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens
