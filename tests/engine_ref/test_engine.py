"""LLMEngine API behaviour on tiny-random (float32): lifecycle, stop conditions, abort, queue
bound, priorities, logprobs, parallel sampling, stats."""

from __future__ import annotations

import math

import pytest

from engine_ref import (
    EngineConfig,
    EngineConfigError,
    EngineError,
    LLMEngine,
    QueueFullError,
    SamplingParams,
)


def make(tiny_model, **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=128,
                   num_threads=1)  # fmt: skip
    options.update(overrides)
    return LLMEngine(EngineConfig(**options), loaded=tiny_model)


def drain(engine: LLMEngine) -> dict:
    """{request_id: {index: {"tokens", "text", "finish_reason", "logprobs", "chunks"}}}"""
    results: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                r = results.setdefault(out.request_id, {}).setdefault(
                    c.index, {"tokens": [], "text": "", "finish_reason": None, "logprobs": []}
                )
                r["tokens"] += c.new_token_ids
                r["text"] += c.new_text
                r["finish_reason"] = c.finish_reason
                r["logprobs"] += c.logprobs or []
    return results


@pytest.fixture
def prompt(tiny_model):
    return tiny_model.tokenizer.encode("The capital of France is Paris. Numbers such as")


def test_max_tokens_and_text_match_tokenizer(tiny_model, prompt):
    engine = make(tiny_model)
    engine.add_request("a", prompt, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    out = drain(engine)["a"][0]
    assert len(out["tokens"]) == 9 and out["finish_reason"] == "length"
    assert out["text"] == tiny_model.tokenizer.decode(out["tokens"])
    assert engine.stats().num_blocks_used == 0


def test_stop_string_truncates_output(tiny_model):
    tok = tiny_model.tokenizer
    prompt = tok.encode("Hello, how are you today?")
    engine = make(tiny_model)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request("free", prompt, greedy)
    text = drain(engine)["free"][0]["text"]
    assert len(text) > 12
    stop = text[6:9]
    cut = text.index(stop)
    engine.add_request("stopped", prompt, SamplingParams(
        max_tokens=30, temperature=0, ignore_eos=True, stop=("zzzz-never", stop)))  # fmt: skip
    out = drain(engine)["stopped"][0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[:cut]


def test_stop_token_ids_and_eos(tiny_model, prompt):
    engine = make(tiny_model)
    engine.add_request(
        "free", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    tokens = drain(engine)["free"][0]["tokens"]
    target = tokens[4]
    first = tokens.index(target)
    engine.add_request("stop", prompt, SamplingParams(
        max_tokens=12, temperature=0, stop_token_ids=(target,)))  # fmt: skip
    out = drain(engine)["stop"][0]
    assert out["tokens"] == tokens[: first + 1] and out["finish_reason"] == "stop"


def test_eos_stops_unless_ignored(tiny_model, prompt):
    engine = make(tiny_model)
    engine.add_request(
        "free", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    tokens = drain(engine)["free"][0]["tokens"]
    # Random weights rarely emit EOS, so declare the 4th greedy token to be one.
    engine.output_processor.eos_token_ids = frozenset({tokens[3]})
    first = tokens.index(tokens[3])
    engine.add_request("eos", prompt, SamplingParams(max_tokens=12, temperature=0))
    engine.add_request(
        "ignored", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    engine.add_request("min", prompt, SamplingParams(max_tokens=12, temperature=0, min_tokens=12))
    out = drain(engine)
    assert out["eos"][0]["tokens"] == tokens[: first + 1]
    assert out["eos"][0]["finish_reason"] == "stop"
    assert out["ignored"][0]["tokens"] == tokens
    assert len(out["min"][0]["tokens"]) == 12 and tokens[3] not in out["min"][0]["tokens"]


def test_abort_frees_every_block_and_is_idempotent(tiny_model, prompt):
    engine = make(tiny_model, num_blocks=64)
    for i in range(4):
        engine.add_request(f"r{i}", prompt * 3, SamplingParams(n=2, max_tokens=50, temperature=1.0))
    for _ in range(3):
        engine.step()
    assert engine.stats().num_blocks_used > 0
    for i in range(4):
        engine.abort(f"r{i}")
        engine.abort(f"r{i}")
    engine.abort("never-existed")
    stats = engine.stats()
    assert stats.num_blocks_used == 0 and stats.num_blocks_free == 64
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert not engine.has_unfinished()
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2", "r3"]
    assert all(o.finished and all(c.finish_reason == "abort" for c in o.outputs) for o in outs)
    assert engine.step() == []


def test_abort_waiting_request(tiny_model, prompt):
    engine = make(tiny_model, max_num_seqs=1)
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("b", prompt, SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    assert engine.stats().num_waiting == 1
    engine.abort("b")
    assert engine.stats().num_waiting == 0
    results = drain(engine)
    assert "b" not in results or results["b"][0]["finish_reason"] == "abort"
    engine.abort("a")  # already finished: no-op
    assert engine.stats().num_blocks_used == 0


def test_queue_bound_rejects_explicitly(tiny_model, prompt):
    engine = make(tiny_model, max_waiting_requests=2)
    engine.add_request("a", prompt, SamplingParams(max_tokens=2))
    engine.add_request("b", prompt, SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError, match="full"):
        engine.add_request("c", prompt, SamplingParams(max_tokens=2))
    assert "c" not in engine.requests
    engine.step()  # a and b leave the waiting queue
    engine.add_request("c", prompt, SamplingParams(max_tokens=2))
    assert set(drain(engine)) >= {"c"}


def test_invalid_requests_raise_one_sentence(tiny_model, prompt):
    engine = make(tiny_model, max_model_len=64)
    with pytest.raises(EngineError):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(EngineError):
        engine.add_request("a", [10**6], SamplingParams())
    with pytest.raises(EngineError, match="max_model_len"):
        engine.add_request("a", prompt * 20, SamplingParams())
    engine.add_request("a", prompt, SamplingParams())
    with pytest.raises(EngineError, match="already in use"):
        engine.add_request("a", prompt, SamplingParams())
    with pytest.raises(EngineConfigError):
        SamplingParams(top_p=0)
    with pytest.raises(EngineConfigError):
        EngineConfig(scheduling_policy="lifo")


def test_missing_cuda_is_a_clear_error(tiny_model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(EngineError, match="CUDA is not available"):
        make(tiny_model, device="cuda")


def test_max_model_len_ends_with_length(tiny_model, prompt):
    engine = make(tiny_model, max_model_len=len(prompt) + 3)
    engine.add_request("a", prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    out = drain(engine)["a"][0]
    assert len(out["tokens"]) == 3 and out["finish_reason"] == "length"


@pytest.mark.parametrize("policy, first", [("fcfs", "low"), ("priority", "high")])
def test_scheduling_policy_order(tiny_model, prompt, policy, first):
    engine = make(tiny_model, max_num_seqs=1, scheduling_policy=policy)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("low", prompt, params, priority=5)
    engine.add_request("high", prompt, params, priority=-1)
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished[0] == first


def test_logprobs_are_normalised_and_include_sampled_token(tiny_model, prompt):
    engine = make(tiny_model)
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0.7, seed=1,
                                                   logprobs=3, ignore_eos=True))  # fmt: skip
    out = drain(engine)["a"][0]
    assert len(out["logprobs"]) == 4
    for token, entry in zip(out["tokens"], out["logprobs"], strict=True):
        assert token in entry and 3 <= len(entry) <= 4
        assert all(v <= 0 for v in entry.values())
        assert sum(math.exp(v) for v in entry.values()) <= 1 + 1e-5


def test_parallel_sampling_returns_n_indexed_outputs(tiny_model, prompt):
    engine = make(tiny_model)
    engine.add_request("a", prompt, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7,
                                                   ignore_eos=True))  # fmt: skip
    out = drain(engine)["a"]
    assert sorted(out) == [0, 1, 2]
    assert all(len(o["tokens"]) == 6 and o["finish_reason"] == "length" for o in out.values())
    assert engine.stats().num_blocks_used == 0


def test_stats_counters(tiny_model, prompt):
    engine = make(tiny_model, block_size=16)
    engine.add_request(
        "a", prompt * 3, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    drain(engine)
    engine.add_request(
        "b", prompt * 3, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    drain(engine)
    s = engine.stats()
    n = len(prompt) * 3
    cached = ((n - 1) // 16) * 16
    assert s.prefix_cache_query_tokens == 2 * n and s.prefix_cache_hit_tokens == cached
    assert s.prompt_tokens_total == 2 * n - cached
    assert s.generation_tokens_total == 10
    assert s.generation_tokens_by_step_kind["decode"] == 8
    mc = tiny_model.config
    assert (
        s.kv_bytes_per_token == 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4
    )
    assert s.num_blocks_total == 128 and s.kv_cache_usage == 0.0


def test_num_blocks_derived_from_memory(tiny_model):
    mc = tiny_model.config
    per_block = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4 * 16
    engine = make(tiny_model, num_blocks=None, kv_cache_memory_bytes=per_block * 10 + 5)
    assert engine.stats().num_blocks_total == 10
    assert engine.max_model_len == 160
