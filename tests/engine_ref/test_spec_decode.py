"""Speculative decoding through `LLMEngine.step` on tiny-random (float32): outputs equal those
without speculation (greedy, and seeded sampling, whose draws the verifier keeps), stop
conditions and logprobs, rollback of rejected drafts (KV, blocks, prefix cache), the token
budget, the per-request switch, the off-switches and the counters."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from test_engine import drain

from engine_ref import EngineConfig, EngineConfigError, EngineError, LLMEngine, SamplingParams
from engine_ref.core.engine_config import SpeculativeConfig
from engine_ref.core.spec_decode import DraftTree, propose_ngram, propose_ngram_tree
from engine_ref.loading.tiny_random import tiny_random_state_dict
from engine_ref.loading.weights import LoadedModel, load_model
from workloads.options import WorkloadOptions
from workloads.registry import resolve_workload

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1, "disable_by_batch_size": None}  # fmt: skip
# The target's first 2 of tiny-random's 4 layers as the draft.
SELF_DRAFT = {"method": "self_draft", "num_draft_layers": 2, "num_speculative_tokens": 3,
              "disable_by_batch_size": None, "disable_below_acceptance_rate": 0.0}  # fmt: skip
# A 2-layer model of other random weights under tiny-random's tokenizer as the draft model.
DRAFT_MODEL = {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 3,
               "disable_by_batch_size": None, "disable_below_acceptance_rate": 0.0}  # fmt: skip
# Token trees of up to 3 n-gram continuations within the same 4-token budget.
NGRAM_TREE = {**NGRAM, "num_tree_branches": 3}
PROPOSERS = [
    pytest.param(NGRAM, id="ngram"),
    pytest.param(NGRAM_TREE, id="ngram-tree"),
    pytest.param(SELF_DRAFT, id="self-draft"),
    pytest.param(DRAFT_MODEL, id="draft-model"),
]


@functools.cache
def tiny_draft(layers: int = 2, seed: int = 999) -> LoadedModel:
    target = load_model("tiny-random", dtype="float32")
    config = dataclasses.replace(target.config, num_hidden_layers=layers)
    state_dict = tiny_random_state_dict(config, seed=seed)
    return LoadedModel(config, state_dict, target.tokenizer, {"name": "tiny-draft"})


def make(tiny_model, spec: dict | None = NGRAM, draft=None, **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=256,
                   num_threads=1, speculative_config=spec)  # fmt: skip
    options.update(overrides)
    if spec is not None and spec["method"] == "draft_model" and draft is None:
        draft = tiny_draft()
    return LLMEngine(EngineConfig(**options), loaded=tiny_model, draft_loaded=draft)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    return drain(engine)


@pytest.fixture(scope="module")
def repeat_prompts(tiny_model) -> list[list[int]]:
    tok = tiny_model.tokenizer
    texts = [
        "one two three four one two three four one two three",
        "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat",
        "a b c d e f g a b c d e f g a b c",
        "Hello world",
    ]
    return [tok.encode(t) for t in texts]


# -- n-gram lookup: hand-worked cases ---------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "min_n", "max_n", "k", "expected"),
    [
        ([], 1, 4, 4, []),  # empty
        ([7], 1, 4, 4, []),  # nothing before the suffix
        ([1, 2, 3], 1, 4, 4, []),  # no earlier occurrence
        ([1, 2, 3, 1], 1, 4, 4, [2, 3, 1]),  # n=1 match at 0, followed by 3 tokens
        ([1, 2, 3, 1], 2, 4, 4, []),  # min_n 2: "3 1" never occurred before
        ([1, 2, 3, 1, 2], 1, 4, 2, [3, 1]),  # n=2 match, k caps the draft
        ([1, 2, 3, 1, 2], 1, 1, 4, [3, 1, 2]),  # max_n 1: "2" matched at 1
        ([5, 9, 1, 2, 8, 1, 2], 2, 2, 1, [8]),  # latest full occurrence wins
        ([1, 2, 3, 1, 2, 3, 1, 2, 3], 1, 3, 0, []),  # k 0
        # "1 1 1 1": the latest occurrence followed by a full draft of 2 (not the tail of 1)
        ([4, 1, 1, 1, 1], 2, 2, 2, [1, 1]),
        # No occurrence followed by k tokens: the earliest (longest tail) one
        ([3, 1, 1, 1], 1, 1, 4, [1, 1]),
    ],
)
def test_ngram_lookup(tokens, min_n, max_n, k, expected):
    assert propose_ngram(tokens, min_n=min_n, max_n=max_n, num_tokens=k) == expected


@pytest.mark.parametrize(
    ("tokens", "k", "branches", "expected_tokens", "expected_parents"),
    [
        ([1, 2, 3], 4, 3, None, None),  # no match
        # One continuation only: the chain.
        ([1, 2, 3, 1, 2], 4, 3, [3, 1, 2], [None, 0, 1]),
        # "1 2" was followed by "3 7 1 2" (latest full), "4 5 1 2" and "3 9 1 2": 3 is shared,
        # depth 1 gets 7 and 5 before the budget of 4 runs out (9 is cut).
        ([1, 2, 3, 9, 1, 2, 4, 5, 1, 2, 3, 7, 1, 2], 4, 3, [3, 7, 4, 5], [None, 0, None, 2]),
        # branches 1 is the chain.
        ([1, 2, 3, 9, 1, 2, 4, 5, 1, 2, 3, 7, 1, 2], 4, 1, [3, 7, 1, 2], [None, 0, 1, 2]),
        # A budget of 2: the two branches' first tokens.
        ([1, 2, 3, 9, 1, 2, 4, 5, 1, 2, 3, 7, 1, 2], 2, 3, [3, 4], [None, None]),
    ],
)
def test_ngram_tree(tokens, k, branches, expected_tokens, expected_parents):
    tree = propose_ngram_tree(tokens, min_n=1, max_n=2, num_tokens=k, num_branches=branches)
    if expected_tokens is None:
        assert tree is None
    else:
        assert (tree.token_ids, tree.parents) == (expected_tokens, expected_parents)


def test_tree_depths_and_ancestry_mask_by_hand():
    tree = DraftTree([3, 7, 4, 5], [None, 0, None, 2])
    assert tree.depths == [1, 2, 1, 2]
    t, f = True, False
    assert tree.ancestry_mask() == [
        [t, f, f, f, f],  # the last token
        [t, t, f, f, f],  # 3
        [t, t, t, f, f],  # 7 after 3
        [t, f, f, t, f],  # 4
        [t, f, f, t, t],  # 5 after 4
    ]
    assert tree.truncated(3) == DraftTree([3, 7, 4], [None, 0, None])


def test_tree_paths_off_the_first_branch_move_their_kv(tiny_model, monkeypatch):
    """Continuations that disagree: some accepted paths leave the first branch, and their KV
    is moved to the positions' slots (outputs equal, as the rollback test checks the KV)."""
    tok = tiny_model.tokenizer
    prompt = tok.encode("a b c a b d a b e a b c a b d a b e a b")
    params = SamplingParams(max_tokens=40, temperature=1.5, seed=4, ignore_eos=True)
    engine = make(tiny_model, spec=NGRAM_TREE)
    moved = []
    original = engine.model_runner.move_accepted_kv
    monkeypatch.setattr(
        engine.model_runner,
        "move_accepted_kv",
        lambda seq, start, path: (moved.append(path), original(seq, start, path)),
    )
    assert run(engine, [prompt], params) == run(make(tiny_model, spec=None), [prompt], params)
    assert any(path != list(range(len(path))) for path in moved)


def test_ngram_lookup_on_a_long_context():
    tokens = list(range(5000)) + list(range(100))
    assert propose_ngram(tokens, min_n=2, max_n=4, num_tokens=3) == [100, 101, 102]


# -- outputs equal those without speculation --------------------------------------------------
@pytest.mark.parametrize("spec", PROPOSERS)
@pytest.mark.parametrize("workload", ["chat", "code", "shared-prefix", "random"])
def test_greedy_outputs_equal_without_speculation_on_builtin_workloads(
    tiny_model, tiny_tokenizer, workload, spec
):
    table = resolve_workload(
        workload, options=WorkloadOptions(num_requests=8), tokenizer=tiny_tokenizer, use_cache=False
    ).table
    prompts = [list(ids)[:200] for ids in table.column("prompt_token_ids").to_pylist()]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = run(make(tiny_model, spec=None), prompts, params)
    engine = make(tiny_model, spec=spec)
    assert run(engine, prompts, params) == plain
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.3, top_k=5, seed=13, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, seed=14, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, logprobs=0, ignore_eos=True),
        SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=15, ignore_eos=True),
    ],
    ids=["greedy", "t1", "top-p", "top-k", "logprobs", "greedy-logprobs", "n3"],
)
@pytest.mark.parametrize("spec", PROPOSERS)
def test_outputs_equal_without_speculation(tiny_model, repeat_prompts, params, spec):
    """Seeded sampled requests too: every emitted token is the draw the non-speculative
    sampler would make at that position, so only the speed changes."""
    plain = run(make(tiny_model, spec=None), repeat_prompts, params)
    engine = make(tiny_model, spec=spec)
    got = run(engine, repeat_prompts, params)
    for rid in plain:
        for index in plain[rid]:
            a, b = plain[rid][index], got[rid][index]
            assert a["tokens"] == b["tokens"] and a["text"] == b["text"]
            assert a["finish_reason"] == b["finish_reason"]
            assert len(a["logprobs"]) == len(b["logprobs"])
            for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
                assert x.keys() == y.keys()
                assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 0
    # tiny-random's outputs are near-deterministic repetitions: a model draft rarely misses.
    if not params.is_greedy and spec["method"] == "ngram":
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts were rejected
    assert engine.stats().num_blocks_used == 0


def test_a_full_depth_self_draft_is_the_target(tiny_model, repeat_prompts):
    """All 4 layers: the draft is the target, so every greedy draft is accepted (a check of
    the draft's KV and positions as much as of verification)."""
    engine = make(tiny_model, spec={**SELF_DRAFT, "num_draft_layers": 4})
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    assert run(engine, repeat_prompts, params) == run(make(tiny_model, spec=None),
                                                      repeat_prompts, params)  # fmt: skip
    stats = engine.stats().spec_decode
    assert stats.num_draft_tokens > 50
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_the_target_as_its_own_draft_model_is_always_accepted(tiny_model, repeat_prompts):
    """The draft's KV follows the target's through prefills, prefix hits and rollbacks: a
    draft model equal to the target then drafts exactly the target's greedy tokens."""
    engine = make(tiny_model, spec=DRAFT_MODEL, draft=tiny_model)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = run(make(tiny_model, spec=None), repeat_prompts, params)
    assert run(engine, repeat_prompts, params) == plain
    assert run(engine, repeat_prompts, params) == plain  # again, from the prefix cache
    stats = engine.stats().spec_decode
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert stats.num_draft_tokens > 50
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_draft_model_with_another_tokenizer_is_one_sentence(tiny_model):
    other = tiny_draft()
    bigger = dataclasses.replace(other.config, vocab_size=other.config.vocab_size + 1)
    draft = LoadedModel(bigger, tiny_random_state_dict(bigger), other.tokenizer, {})
    with pytest.raises(EngineError, match="does not share the target's tokenizer"):
        make(tiny_model, spec=DRAFT_MODEL, draft=draft)


def test_a_failing_drafter_costs_speed_not_outputs(tiny_model, repeat_prompts, monkeypatch):
    engine = make(tiny_model, spec=SELF_DRAFT)

    def broken(*args):
        raise RuntimeError("draft forward failed")

    monkeypatch.setattr(engine.model_runner.drafter, "next_tokens", broken)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert run(engine, repeat_prompts, params) == run(make(tiny_model, spec=None),
                                                      repeat_prompts, params)  # fmt: skip
    assert engine.stats().spec_decode.num_drafts > 0


@pytest.mark.parametrize("spec", PROPOSERS)
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 6, 7])
def test_max_tokens_boundaries(tiny_model, repeat_prompts, max_tokens, spec):
    """Just below, at and above the draft length plus the token a verify step adds."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    plain = run(make(tiny_model, spec=None), repeat_prompts, params)
    got = run(make(tiny_model, spec=spec), repeat_prompts, params)
    assert got == plain
    assert all(len(r[0]["tokens"]) == max_tokens for r in got.values())


def test_stop_strings_and_ids_never_see_rejected_or_later_tokens(tiny_model, repeat_prompts):
    tok = tiny_model.tokenizer
    plain_out = run(make(tiny_model, spec=None), repeat_prompts,
                    SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))  # fmt: skip
    for rid, result in plain_out.items():
        tokens = result[0]["tokens"]
        # A stop string from the middle of the output, and the id of its 6th token.
        stop_text = tok.decode(tokens[8:10]).strip() or tok.decode(tokens[8:12])
        for params in (
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=(stop_text,)),
            SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(tokens[5],)),
        ):
            prompt = [repeat_prompts[int(rid)]]
            plain = run(make(tiny_model, spec=None), prompt, params)
            engine = make(tiny_model)
            assert run(engine, prompt, params) == plain
            assert engine.stats().num_blocks_used == 0


@pytest.mark.parametrize("spec", PROPOSERS)
def test_max_model_len_bounds_drafts(tiny_model, repeat_prompts, spec):
    prompt = repeat_prompts[0]
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    for limit in (len(prompt) + 1, len(prompt) + 2, len(prompt) + 5, len(prompt) + 9):
        plain = run(make(tiny_model, spec=None, max_model_len=limit), [prompt], params)
        got = run(make(tiny_model, spec=spec, max_model_len=limit), [prompt], params)
        assert got == plain and len(got["0"][0]["tokens"]) == limit - len(prompt)


# -- rollback ---------------------------------------------------------------------------------
def _kv_of(engine: LLMEngine, seq) -> list[torch.Tensor]:
    """Per layer [2 * kvh, num_computed_tokens, hd]: the KV of the sequence's computed tokens."""
    bs = engine.config.block_size
    slots = [seq.block_table[p // bs] * bs + p % bs for p in range(seq.num_computed_tokens)]
    index = torch.tensor(slots)
    return [pool.flatten(1, 2).index_select(1, index) for pool in engine.model_runner.kv_caches]


@pytest.mark.parametrize("spec", PROPOSERS)
def test_rollback_keeps_accepted_kv_and_frees_rejected_blocks(tiny_model, spec):
    tok = tiny_model.tokenizer
    prompt = tok.encode("Repeat after me: the cat sat on the mat. The cat sat on the mat. The")
    params = SamplingParams(max_tokens=60, temperature=2.5, seed=1, ignore_eos=True)
    plain = make(tiny_model, spec=None, block_size=4)
    spec = make(tiny_model, spec=spec, block_size=4)
    plain.add_request("a", prompt, params)
    spec.add_request("a", prompt, params)
    rejected_seen = False
    while spec.has_unfinished():
        spec.step()
        stats = spec.stats().spec_decode
        if not spec.has_unfinished():
            break
        seq = spec.requests["a"].sequences[0]
        rejected_seen |= stats.num_accepted_tokens < stats.num_draft_tokens
        # Step the plain engine to the same length and compare the computed KV.
        ref = plain.requests["a"].sequences[0]
        while ref.num_tokens < seq.num_tokens:
            plain.step()
        assert ref.token_ids == seq.token_ids
        assert seq.num_computed_tokens == seq.num_tokens - 1 == ref.num_computed_tokens
        # No block past the one for the next position: the rejected tail was freed.
        assert -(-seq.num_computed_tokens // 4) <= len(seq.block_table) <= -(-seq.num_tokens // 4)
        for a, b in zip(_kv_of(spec, seq), _kv_of(plain, ref), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert rejected_seen
    while plain.has_unfinished():
        plain.step()
    # Idle pool; every cached block holds tokens of the final sequence at its own position.
    final = prompt + drain_tokens(spec, prompt, params)
    bm = spec.block_manager
    assert spec.stats().num_blocks_used == 0 and bm.num_free_blocks == bm.num_blocks
    assert bm.num_cached_blocks > len(prompt) // 4
    blocks = {tuple(final[i * 4 : (i + 1) * 4]) for i in range(len(final) // 4)}
    for block in bm.key_to_block.values():
        assert bm.block_tokens[block] in blocks


def drain_tokens(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    """The output tokens of `prompt` once more on `engine` (prefix cache warm): equal to the
    first run's, so it stands for the sequence the cache should hold."""
    engine.add_request("again", prompt, params)
    return drain(engine)["again"][0]["tokens"]


def test_rejected_drafts_never_enter_the_prefix_cache(tiny_model):
    """block_size 1: every computed token fills a block, so a registered rejected token would
    show; every cached block's token must be the token at its position."""
    tok = tiny_model.tokenizer
    prompt = tok.encode("a b c d e f g a b c d e f g a b c")
    params = SamplingParams(max_tokens=40, temperature=1.2, seed=9, ignore_eos=True)
    engine = make(tiny_model, block_size=1)
    out = run(engine, [prompt], params)["0"][0]["tokens"]
    stats = engine.stats().spec_decode
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    final = prompt + out
    bm = engine.block_manager
    cached = sorted(bm.block_tokens[b] for b in bm.key_to_block.values())
    assert cached and all(t[0] in final for t in cached)
    assert len(cached) == len(final) - 1  # every computed token, and only those
    assert engine.stats().num_blocks_used == 0


# -- scheduling -------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [1, 2, 3, 5, 6])
def test_drafts_count_against_the_token_budget(tiny_model, repeat_prompts, budget):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = repeat_prompts[:2]
    plain = run(make(tiny_model, spec=None, max_num_batched_tokens=budget), prompts, params)
    engine = make(tiny_model, max_num_batched_tokens=budget)
    batches = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        batches.append((batch.num_tokens, sum(q.num_lookahead_tokens for q in batch.seqs)))
        return batch

    engine.scheduler.schedule = recording_schedule
    assert run(engine, prompts, params) == plain
    # Every step's rows, drafted tokens included, fit the budget.
    assert all(num_tokens <= budget for num_tokens, _ in batches)
    drafted = sum(drafts for _, drafts in batches)
    assert drafted == engine.stats().spec_decode.num_draft_tokens
    # A budget of 1 is the decode row itself: nothing is left to draft.
    assert (drafted > 0) is (budget > 1)


def test_speculation_is_per_request(tiny_model, repeat_prompts):
    engine = make(tiny_model)
    off = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, speculative=False)
    run(engine, repeat_prompts, off)
    assert engine.stats().spec_decode.num_drafts == 0
    on = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    run(engine, repeat_prompts[:1], on)
    assert engine.stats().spec_decode.num_drafts > 0
    assert make(tiny_model, spec=None).stats().spec_decode is None


@pytest.mark.parametrize(("cap", "drafts"), [(3, False), (4, True), (5, True)])
def test_off_switch_by_batch_size(tiny_model, repeat_prompts, cap, drafts):
    engine = make(tiny_model, spec={**NGRAM, "disable_by_batch_size": cap})
    run(engine, repeat_prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    spec = engine.stats().spec_decode
    # 4 requests run together after their prefills: above the cap nobody drafts.
    assert (spec.num_drafts > 0) is drafts
    assert spec.num_steps_off_by_batch_size > 0 if not drafts else True


def test_off_switch_below_break_even_acceptance(tiny_model):
    tok = tiny_model.tokenizer
    prompt = tok.encode("a b c d e f g a b c d e f g a b c")
    params = SamplingParams(max_tokens=60, temperature=1.5, seed=2, ignore_eos=True)
    paused = make(tiny_model, spec={**NGRAM, "disable_below_acceptance_rate": 0.99})
    always = make(tiny_model, spec={**NGRAM, "disable_below_acceptance_rate": 0.0})
    assert run(paused, [prompt], params) == run(always, [prompt], params)
    a, b = paused.stats().spec_decode, always.stats().spec_decode
    assert a.num_paused_proposals > 0 and a.num_drafts < b.num_drafts
    assert b.num_paused_proposals == 0


def test_counters_match_the_emitted_tokens(tiny_model, repeat_prompts):
    engine = make(tiny_model)
    params = SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)
    out = run(engine, repeat_prompts, params)
    stats = engine.stats()
    spec = stats.spec_decode
    assert stats.generation_tokens_total == sum(len(r[0]["tokens"]) for r in out.values())
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
    assert spec.num_accepted_tokens_per_pos == tuple(sorted(spec.num_accepted_tokens_per_pos,
                                                            reverse=True))  # fmt: skip
    # Decode steps: 4 requests x 24 tokens after the first, fewer with accepted drafts.
    assert stats.num_steps < 1 + 24 - spec.num_accepted_tokens // 4 + 1
    assert spec.acceptance_rate == spec.num_accepted_tokens / spec.num_draft_tokens
    assert spec.mean_accepted_length == 1 + spec.num_accepted_tokens / spec.num_drafts


# -- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "eagle"}', "Unknown speculative method 'eagle'"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be at least 1"),
        ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "must not exceed"),
        ('{"disable_by_batch_size": 0}', "disable_by_batch_size must be at least 1"),
        ('{"disable_below_acceptance_rate": 1.5}', "must be in [0, 1]"),
        ('{"num_spec_tokens": 4}', "Unknown speculative-config key 'num_spec_tokens'"),
        ('{"method": "self_draft"}', "method self_draft needs num_draft_layers"),
        ('{"method": "self_draft", "num_draft_layers": 0}', "num_draft_layers must be at least 1"),
        ('{"num_draft_layers": 2}', "num_draft_layers applies to method self_draft only"),
        ('{"method": "draft_model"}', "method draft_model needs model"),
        ('{"model": "tiny-random"}', "model applies to method draft_model only"),
        ('{"num_tree_branches": 0}', "num_tree_branches must be at least 1"),
        (
            '{"method": "self_draft", "num_draft_layers": 1, "num_tree_branches": 2}',
            "num_tree_branches above 1 applies to method ngram only",
        ),
    ],
)
def test_bad_speculative_config_is_one_sentence(text, message):
    with pytest.raises(EngineConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        EngineConfig(speculative_config=text)


def test_self_draft_deeper_than_the_model_is_one_sentence(tiny_model):
    with pytest.raises(EngineError, match="num_draft_layers=5 exceeds the model's 4 layers"):
        make(tiny_model, spec={**SELF_DRAFT, "num_draft_layers": 5})


def test_speculative_config_from_json_and_dict():
    text = (
        '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":5,"prompt_lookup_min":2}'
    )
    a = EngineConfig(speculative_config=text).speculative_config
    b = EngineConfig(speculative_config={"num_speculative_tokens": 3, "prompt_lookup_max": 5,
                                         "prompt_lookup_min": 2}).speculative_config  # fmt: skip
    assert a == b == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5,
                                       prompt_lookup_min=2)  # fmt: skip
    with pytest.raises(EngineConfigError, match="speculative must be true or false"):
        SamplingParams(speculative="yes")
