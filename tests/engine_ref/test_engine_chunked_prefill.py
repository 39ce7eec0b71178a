"""Chunked prefill through `LLMEngine.step`: prompts at, just below and just above 1x, 2x and
3x the token budget, on an idle engine and beside decoding requests, give the greedy tokens of
a one-step prefill, and leave the block pool idle."""

from __future__ import annotations

import random

import pytest

from engine_ref import EngineConfig, LLMEngine, SamplingParams

BUDGET = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# Decoding throughout the long prompt's prefill (at most 4 chunks).
DECODING = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def make(tiny_model, **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=128,
                   num_threads=1)  # fmt: skip
    options.update(overrides)
    return LLMEngine(EngineConfig(**options), loaded=tiny_model)


def run(
    engine: LLMEngine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    *,
    late: tuple[str, ...] = (),
    delay_steps: int = 2,
) -> dict:
    """Add `requests` in order (those named in `late` after `delay_steps` steps), step to the
    end; {request_id: (tokens, finish_reason)}."""
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    reasons: dict[str, str | None] = {}

    def collect() -> None:
        for out in engine.step():
            assert out.error is None
            tokens[out.request_id] += out.outputs[0].new_token_ids
            reasons[out.request_id] = out.outputs[0].finish_reason

    for request_id, (prompt, params) in requests.items():
        if request_id not in late:
            engine.add_request(request_id, prompt, params)
    if late:
        for _ in range(delay_steps):
            collect()
        for request_id in late:
            engine.add_request(request_id, *requests[request_id])
    while engine.has_unfinished():
        collect()
    return {request_id: (tokens[request_id], reasons[request_id]) for request_id in requests}


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("with_decoding", [False, True], ids=["idle", "decoding"])
@pytest.mark.parametrize("multiple", [1, 2, 3])
@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_chunked_prefill_matches_one_step_prefill(
    tiny_model, block_size, with_decoding, multiple, offset
):
    length = multiple * BUDGET + offset
    requests = {"long": (prompt_of(length, seed=length), GREEDY)}
    if with_decoding:
        requests = {
            "d1": (prompt_of(5, seed=1), DECODING),
            "d2": (prompt_of(3, seed=2), DECODING),
            **requests,
        }
    whole = run(make(tiny_model, block_size=block_size, max_num_batched_tokens=4096), requests)
    engine = make(tiny_model, block_size=block_size, max_num_batched_tokens=BUDGET)
    # The decoding requests are past their prompts when the long one arrives.
    late = ("long",) if with_decoding else ()
    assert run(engine, requests, late=late) == whole
    assert whole["long"][1] == "length" and len(whole["long"][0]) == 6
    stats = engine.stats()
    assert stats.num_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.prompt_tokens_total >= length


def test_default_budget_prefills_a_long_prompt_on_an_idle_engine(tiny_model):
    """With the default budget (2048), a longer prompt on an idle engine used to fail its
    first step (no row samples in a chunk that ends inside the prompt)."""
    prompt = prompt_of(2100, seed=3)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    options = dict(num_blocks=160, max_model_len=2560)
    chunked = run(make(tiny_model, **options), {"a": (prompt, params)})
    whole = run(make(tiny_model, **options, max_num_batched_tokens=4096), {"a": (prompt, params)})
    assert chunked == whole and len(chunked["a"][0]) == 2
