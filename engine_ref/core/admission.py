"""What `LLMEngine.add_request` accepts: the checks that need the engine (its vocabulary, context
length and batch bound), so that everything admitted is something a step can execute.
`SamplingParams` validates what needs no engine when it is built."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from engine_ref.core.engine_config import SamplingParams


class EngineError(ValueError):
    """A request the engine cannot serve (bad prompt, duplicate id, too long)."""


def check_prompt(
    prompt_token_ids: Iterable[object], *, vocab_size: int, max_model_len: int
) -> list[int]:
    """The prompt as plain ints; raises EngineError when it is empty, holds a non-integer or an
    id outside [0, vocab_size), or leaves no room for one output token."""
    try:  # plain ints (bools are not: their type is bool) need no conversion
        prompt = list(prompt_token_ids)
        if not all(type(t) is int for t in prompt):
            prompt = [_token_id(t) for t in prompt]
    except TypeError:
        raise EngineError("Prompt token ids must be integers.") from None
    if not prompt:
        raise EngineError("The prompt has no tokens.")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise EngineError(f"Prompt token ids must be in [0, {vocab_size}).")
    if len(prompt) >= max_model_len:
        raise EngineError(
            f"The prompt has {len(prompt)} tokens; this engine serves at most "
            f"{max_model_len - 1} (max_model_len {max_model_len})."
        )
    return prompt


MAX_TENANT_CHARS = 256
MAX_DEADLINE_MS = 10**12  # about 30 years: beyond it, a deadline is no deadline


def check_request(
    params: object,
    *,
    priority: object,
    cache_salt: object,
    vocab_size: int,
    tenant: object = None,
    max_num_seqs: int,
    deadline_ms: object = None,
) -> None:
    """Raises EngineError for sampling parameters this engine cannot run: not a
    SamplingParams, more parallel samples than a step may hold, stop token ids outside the
    vocabulary; for a non-integer priority, an empty or non-string cache salt, a tenant
    that is not a short string, and a deadline that is not a whole number of milliseconds
    in [1, `MAX_DEADLINE_MS`]."""
    if not isinstance(params, SamplingParams):
        raise EngineError(f"params must be a SamplingParams, got {type(params).__name__}.")
    if params.n > max_num_seqs:
        raise EngineError(f"n is {params.n}; this engine runs at most {max_num_seqs} sequences.")
    if params.beam_width > max_num_seqs:
        raise EngineError(
            f"The beam width is {params.beam_width}; this engine runs at most {max_num_seqs} "
            "sequences."
        )
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise EngineError(f"stop_token_ids must be in [0, {vocab_size}).")
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise EngineError(f"priority must be an integer, got {priority!r}.")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise EngineError("cache_salt must be a non-empty string or None.")
    if tenant is not None and (not isinstance(tenant, str) or len(tenant) > MAX_TENANT_CHARS):
        raise EngineError(
            f"tenant must be a string of at most {MAX_TENANT_CHARS} characters or None."
        )
    if deadline_ms is not None and (
        isinstance(deadline_ms, bool)
        or not isinstance(deadline_ms, numbers.Integral)
        or not 1 <= deadline_ms <= MAX_DEADLINE_MS
    ):
        raise EngineError(
            f"deadline_ms must be a whole number of milliseconds from 1 to {MAX_DEADLINE_MS}, "
            f"got {deadline_ms!r}."
        )


def _token_id(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(value)
    return int(value)
