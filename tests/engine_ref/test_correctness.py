"""Engine-level equivalences: batching, chunking, prefix caching, preemption, copy-on-write and
hash collisions must never change what a request computes.

The model is a small random Llama (float32) whose greedy outputs vary from token to token; each
comparison checks the generated tokens and the top-5 logprobs of every step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine_ref import EngineConfig, LLMEngine, SamplingParams
from engine_ref.core.attention import build_attention_metadata, kv_pool_shape
from engine_ref.core.config import ModelConfig
from engine_ref.loading.tiny_random import build_tiny_tokenizer, tiny_random_state_dict

LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def varied_model():
    """A random Llama whose greedy continuations change token often (the stock tiny-random
    weights mostly repeat the last token, which would make equality tests too easy)."""
    tokenizer = build_tiny_tokenizer()
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    sd = tiny_random_state_dict(config, seed=5)
    sd["model.embed_tokens.weight"] *= 0.1
    for name in sd:
        if "o_proj" in name or "down_proj" in name:
            sd[name] = sd[name] * 3
    return SimpleNamespace(config=config, state_dict=sd, tokenizer=tokenizer)


def make_engine(loaded, **overrides) -> LLMEngine:
    options = dict(
        model="varied",
        dtype="float32",
        device="cpu",
        num_blocks=256,
        block_size=8,
        num_threads=1,
        max_num_batched_tokens=512,
    )
    options.update(overrides)
    hash_fn = options.pop("hash_fn", None)
    extra = {} if hash_fn is None else {"hash_fn": hash_fn}
    return LLMEngine(EngineConfig(**options), loaded=loaded, **extra)


def prompts(count: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 500, (shared_prefix,), generator=gen).tolist()
    lengths = torch.randint(5, 40, (count,), generator=gen).tolist()
    return [prefix + torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)


def run(engine: LLMEngine, requests, params=GREEDY, *, all_at_once: bool = True):
    """Outputs {(request_id, index): (tokens, logprobs)}; requests added together, or each run
    to completion before the next is added."""
    results: dict = {}

    def drain():
        while engine.has_unfinished():
            for out in engine.step():
                for c in out.outputs:
                    tokens, lps = results.setdefault((out.request_id, c.index), ([], []))
                    tokens += c.new_token_ids
                    lps += c.logprobs or []

    for i, prompt in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
        if not all_at_once:
            drain()
    drain()
    return results


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key][0] == b[key][0], key
        for lp_a, lp_b in zip(a[key][1], b[key][1], strict=True):
            assert lp_a.keys() == lp_b.keys()
            for token in lp_a:
                assert abs(lp_a[token] - lp_b[token]) < LOGPROB_ATOL


@pytest.fixture(scope="module")
def baseline(varied_model):
    """Each request alone, no prefix cache, no chunking."""
    reqs = prompts(16, shared_prefix=20)
    out = {}
    for i, p in enumerate(reqs):
        engine = make_engine(
            varied_model, enable_prefix_caching=False, enable_chunked_prefill=False
        )
        single = run(engine, [p])
        out[(f"r{i}", 0)] = single[("r0", 0)]
    return reqs, out


def test_outputs_vary(baseline):
    _, out = baseline
    tokens = out[("r0", 0)][0]
    assert len(set(tokens)) >= 4  # the model is not degenerate, so equality tests mean something


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_batched_greedy_matches_alone(varied_model, baseline, prefix_caching, chunked):
    reqs, expected = baseline
    engine = make_engine(
        varied_model,
        enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=48 if chunked else 512,
    )
    got = run(engine, reqs, all_at_once=not prefix_caching)
    assert_same(got, expected)
    stats = engine.stats()
    if prefix_caching:
        assert stats.prefix_cache_hit_tokens >= 15 * 16  # the shared 20-token prefix: 2 blocks
    else:
        assert stats.prefix_cache_hit_tokens == 0
    assert stats.num_blocks_used == 0


def test_preemption_keeps_outputs(varied_model, baseline):
    reqs, expected = baseline
    # 16 requests of up to ~70 tokens need ~9 blocks each; 40 blocks force preemptions.
    engine = make_engine(varied_model, num_blocks=40, max_num_batched_tokens=64)
    got = run(engine, reqs)
    assert engine.stats().num_preemptions > 0
    assert_same(got, expected)
    assert engine.stats().num_blocks_used == 0


@pytest.mark.parametrize("hash_name", ["constant", "tokens_only"])
def test_hash_collisions_never_serve_wrong_kv(varied_model, baseline, hash_name):
    reqs, expected = baseline
    hash_fn = {
        "constant": lambda parent, tokens: 0,
        # Ignores the parent: equal blocks after different prefixes collide.
        "tokens_only": lambda parent, tokens: hash(tokens),
    }[hash_name]
    # Block Y follows X in the first extra prompt; Z gets cached by the second; the third is
    # Z + Y: its first block is a true hit, and only the parent check rejects the cached Y
    # (computed after X) for its second block.
    x, y, z, w = ([t] * 8 for t in (5, 6, 7, 8))
    extra = [x + y + [9, 10], z + w + [9, 10], z + y + [9, 10]]
    engine = make_engine(varied_model, hash_fn=hash_fn)
    got = run(engine, reqs + extra, all_at_once=False)
    assert_same({k: v for k, v in got.items() if int(k[0][1:]) < 16}, expected)
    for i, p in enumerate(extra):
        alone = run(make_engine(varied_model, enable_prefix_caching=False), [p])
        assert_same({("r0", 0): got[(f"r{16 + i}", 0)]}, alone)


def teacher_forced_logprobs(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """log-softmax [S, V] of every position, by one fresh prefill through the engine's model
    into scratch pools (no block manager involved)."""
    model = engine.model
    mc = engine.model_config
    bs = 8
    table = list(range((len(tokens) + bs - 1) // bs))
    shape = kv_pool_shape(len(table), bs, mc.num_key_value_heads, mc.head_dim)
    pools = [torch.zeros(shape) for _ in range(mc.num_hidden_layers)]
    meta = build_attention_metadata(
        start_positions=[0],
        num_new_tokens=[len(tokens)],
        block_tables=[table],
        block_size=bs,
        num_queries_per_kv=mc.num_attention_heads // mc.num_key_value_heads,
        num_kv_heads=mc.num_key_value_heads,
        num_pool_blocks=len(table),
        device=torch.device("cpu"),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), meta, pools)
        return model.compute_logits(hidden).log_softmax(-1)


def test_parallel_sampling_copy_on_write_keeps_each_sequence_kv(varied_model):
    engine = make_engine(varied_model)
    prompt = prompts(1, seed=9)[0][:21]  # 21 tokens: the third block is shared and partial
    other = prompts(2, seed=10)[1]
    params = SamplingParams(
        n=3, max_tokens=10, temperature=1.5, seed=4, ignore_eos=True, logprobs=0
    )
    # The n = 3 request forks in the same step as another request samples.
    engine.add_request("forked", prompt, params)
    engine.add_request("single", other, SamplingParams(max_tokens=10, temperature=1.5, seed=5,
                                                       ignore_eos=True, logprobs=0))  # fmt: skip
    got = run(engine, [])
    outputs = [(prompt, got[("forked", i)]) for i in range(3)] + [(other, got[("single", 0)])]
    assert len({tuple(t) for _, (t, _) in outputs[:3]}) > 1  # they diverged: COW exercised
    for p, (tokens, lps) in outputs:
        ref = teacher_forced_logprobs(engine, p + tokens)
        for j, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
            assert abs(lp[token] - ref[len(p) - 1 + j, token].item()) < LOGPROB_ATOL
    assert engine.stats().num_blocks_used == 0


def test_seeded_sampling_reproduces_across_batches(varied_model):
    params = SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=123, ignore_eos=True
    )
    reqs = prompts(6, seed=3)
    alone = run(make_engine(varied_model), reqs[:1], params)[("r0", 0)][0]
    batched = run(make_engine(varied_model), reqs, params)[("r0", 0)][0]
    assert alone == batched
    other = run(
        make_engine(varied_model),
        reqs[:1],
        SamplingParams(
            max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=124, ignore_eos=True
        ),
    )
    assert other[("r0", 0)][0] != alone
