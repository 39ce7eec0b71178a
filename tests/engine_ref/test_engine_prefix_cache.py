"""Prefix-cache accounting and tenant isolation through `LLMEngine.add_request` / `step` /
`stats`: query and hit tokens count once per admitted request (a preempted request's
re-admission apart), and `cache_salt` decides which requests may share prefix blocks."""

from __future__ import annotations

import pytest

from engine_ref import EngineConfig, EngineError, LLMEngine, SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
PROMPT = list(range(100, 112))  # 12 tokens: 3 full blocks, 2 of them servable from cache


def make(tiny_model, **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=64,
                   num_threads=1, block_size=BS)  # fmt: skip
    options.update(overrides)
    return LLMEngine(EngineConfig(**options), loaded=tiny_model)


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
    return tokens


# -- counters --------------------------------------------------------------------------------
def test_a_request_waiting_for_blocks_is_counted_once(tiny_model):
    """16 blocks of 4: "a" (56 prompt tokens, the whole budget, then 8 outputs) grows to all
    16, so "b" (20 tokens, 5 blocks) waits until "a" finishes, being looked up every step; it
    counts once."""
    engine = make(tiny_model, num_blocks=16, max_num_batched_tokens=56)
    engine.add_request("a", list(range(200, 256)), SamplingParams(max_tokens=8, temperature=0,
                                                                   ignore_eos=True))  # fmt: skip
    engine.add_request("b", list(range(300, 320)), GREEDY)
    waited = 0
    while "a" in engine.requests:
        engine.step()
        waited += engine.stats().num_waiting
    assert waited >= 5
    drain(engine)
    s = engine.stats()
    assert s.num_preemptions == 0
    assert s.prefix_cache_query_tokens == 56 + 20 and s.prefix_cache_hit_tokens == 0
    assert s.prefix_cache_preempted_query_tokens == 0


def test_hits_count_servable_full_blocks_once_per_request(tiny_model):
    """Hand-worked: the second and third 12-token prompts find 2 blocks (8 tokens); the last
    token's block is always computed. The third waits behind max_num_seqs=1 for steps."""
    engine = make(tiny_model, max_num_seqs=1)
    engine.add_request("a", PROMPT, GREEDY)
    drain(engine)
    engine.add_request("b", PROMPT, GREEDY)
    engine.add_request("c", PROMPT, GREEDY)
    drain(engine)
    s = engine.stats()
    assert s.prefix_cache_query_tokens == 3 * 12 and s.prefix_cache_hit_tokens == 2 * 8
    assert s.prefix_cache_hit_rate == pytest.approx(16 / 36)


def test_a_preempted_request_is_counted_apart(tiny_model):
    """10 blocks of 4 and two 16-token prompts decoding 20 tokens: the pool cannot hold both
    to the end, so the later arrival is preempted and re-admitted (recomputed, mostly from its
    own cached blocks); new-request counters stay at the two prompts."""
    engine = make(tiny_model, num_blocks=10, max_model_len=40)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(10, 26)), params)
    engine.add_request("b", list(range(30, 46)), params)
    drain(engine)
    s = engine.stats()
    assert s.num_preemptions >= 1
    assert s.prefix_cache_query_tokens == 32 and s.prefix_cache_hit_tokens == 0
    assert s.prefix_cache_preempted_query_tokens > 16
    assert 0 < s.prefix_cache_preempted_hit_tokens < s.prefix_cache_preempted_query_tokens


# -- cache_salt ------------------------------------------------------------------------------
def cached_blocks_after(engine: LLMEngine, request_id: str, salt: str | None) -> tuple:
    """Add the prompt with `salt`, take one step; (its cached tokens, its first blocks)."""
    engine.add_request(request_id, PROMPT, GREEDY, cache_salt=salt)
    engine.step()
    table = list(engine.requests[request_id].sequences[0].block_table[:2])
    cached = engine.requests[request_id].num_cached_tokens
    drain(engine)
    return cached, table


@pytest.mark.parametrize(
    "first, second, shared",
    [
        ("tenant-a", "tenant-b", False),
        ("tenant-a", None, False),
        (None, "tenant-a", False),
        ("tenant-a", "tenant-a", True),
        (None, None, True),
    ],
)
def test_cache_salt_decides_sharing(tiny_model, first, second, shared):
    engine = make(tiny_model)
    _, first_blocks = cached_blocks_after(engine, "one", first)
    hits_before = engine.stats().prefix_cache_hit_tokens
    cached, second_blocks = cached_blocks_after(engine, "two", second)
    hits = engine.stats().prefix_cache_hit_tokens - hits_before
    if shared:
        assert cached == hits == 8 and second_blocks == first_blocks
    else:
        assert cached == hits == 0 and not set(second_blocks) & set(first_blocks)
    assert engine.stats().num_blocks_used == 0


def test_cache_salt_isolation_survives_hash_collisions(tiny_model):
    """Every key collides: tenants still share nothing (a first block's hit is verified
    against the root key, which binds the salt), while one tenant still hits its own block."""
    engine = LLMEngine(
        EngineConfig(
            model="tiny-random",
            dtype="float32",
            device="cpu",
            num_blocks=64,
            num_threads=1,
            block_size=BS,
        ),  # fmt: skip
        loaded=tiny_model,
        hash_fn=lambda parent_key, tokens: 0,
    )
    cached_blocks_after(engine, "a", "tenant-a")
    assert cached_blocks_after(engine, "b", "tenant-b")[0] == 0
    assert cached_blocks_after(engine, "c", None)[0] == 0
    assert cached_blocks_after(engine, "d", "tenant-a")[0] == 4  # block 2 collides with block 1


def test_salted_outputs_equal_unsalted(tiny_model):
    engine = make(tiny_model)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("plain", PROMPT, params)
    engine.add_request("salted", PROMPT, params, cache_salt="t")
    out = drain(engine)
    assert out["plain"] == out["salted"] and len(out["plain"]) == 6


@pytest.mark.parametrize("salt", ["", 7])
def test_bad_cache_salt_is_rejected(tiny_model, salt):
    with pytest.raises(EngineError, match="cache_salt"):
        make(tiny_model).add_request("a", PROMPT, GREEDY, cache_salt=salt)
