"""What `LLMEngine.step` returns: per request, per sequence, the tokens and text of one step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """What one sequence produced in one step (`new_*`) and its totals so far. `finish_reason`
    is None while it runs, then "stop", "length", "abort", or "error" (the engine failed it;
    see `RequestOutput.error`)."""

    index: int
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None
    num_output_tokens: int
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """One request's progress in one step. `error` is set (one line) when the engine failed
    the request: then `finished` is true and every output's finish_reason is "error"."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    # Memory per request, on the finished output (`core.kv_accounting`); None before.
    kv_memory: dict | None = None
    # Tokens whose KV the request evicted (`core.kv_eviction`): above 0, its outputs were
    # computed from a lossy context.
    kv_evicted_tokens: int = 0
