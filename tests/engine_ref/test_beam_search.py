"""Beam search through `LLMEngine.step` against a naive beam search written here: full
recompute, no cache (every candidate prefix is scored by a request of its own on an engine
without a prefix cache), the same rule as `OutputProcessor._beam_step` says. Then the KV: beams
share their prefix blocks (forks), every block returns to the pool when the requests end, and
a pool too small for every beam preempts and still gives the same answer."""

from __future__ import annotations

import pytest

from engine_ref import EngineConfig, EngineConfigError, EngineError, LLMEngine, SamplingParams

PROMPTS = ["Hello world, this is", "Once upon a time", "The cat sat"]


def make(tiny_model, **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=256,
                   num_threads=1, block_size=4)  # fmt: skip
    options.update(overrides)
    return LLMEngine(EngineConfig(**options), loaded=tiny_model)


def next_logprobs(scorer: LLMEngine, ids: list[int], k: int) -> dict[int, float]:
    """The k most likely next tokens after `ids` and their log-probabilities, from a request
    of their own."""
    rid = f"q{len(scorer.requests)}-{hash(tuple(ids))}"
    scorer.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0, logprobs=k))
    result = None
    while scorer.has_unfinished():
        for out in scorer.step():
            if out.request_id == rid and out.outputs:
                result = out.outputs[0].logprobs[0]
    assert result is not None
    return result


def naive_beam_search(scorer, prompt, params, ends) -> list[tuple[tuple[int, ...], str]]:
    width = params.beam_width
    beams: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    finished: list[tuple[tuple[int, ...], float, str]] = []
    while beams and len(finished) < width:
        ranked = []
        for order, (tokens, score) in enumerate(beams):
            lps = next_logprobs(scorer, prompt + list(tokens), 2 * width)
            top = sorted(lps.items(), key=lambda kv: (-kv[1], kv[0]))[: 2 * width]
            ranked += [(score + lp, order, token) for token, lp in top]
        ranked.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen = []
        for rank, (score, order, token) in enumerate(ranked):
            if len(chosen) == width:
                break
            tokens = beams[order][0] + (token,)
            if token in ends:
                if rank < width:
                    finished.append((tokens, score, "stop"))
                continue
            chosen.append((tokens, score))
        beams = []
        for tokens, score in chosen:
            if len(tokens) >= params.max_tokens:
                finished.append((tokens, score, "length"))
            else:
                beams.append((tokens, score))
    best = sorted(finished, key=lambda h: -h[1] / len(h[0]) ** params.length_penalty)
    return [(tokens, reason) for tokens, _, reason in best[: params.n]]


def engine_beam_search(engine, prompts, params) -> dict[str, list[tuple[tuple[int, ...], str]]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finished, "beam search streams nothing before it ends"
            got[out.request_id] = [
                (tuple(c.new_token_ids), c.finish_reason)
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
    return got


@pytest.mark.parametrize(
    ("n", "best_of", "max_tokens", "length_penalty"),
    [(1, None, 6, 1.0), (2, None, 7, 1.0), (4, None, 6, 0.0), (2, 4, 9, 2.0), (1, 1, 1, 1.0)],
)
def test_beam_search_equals_a_naive_beam_search(tiny_model, n, best_of, max_tokens, length_penalty):
    engine = make(tiny_model)
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(n=n, best_of=best_of, use_beam_search=True, max_tokens=max_tokens,
                            length_penalty=length_penalty, temperature=0)  # fmt: skip
    got = engine_beam_search(engine, prompts, params)
    scorer = make(tiny_model, enable_prefix_caching=False)
    ends = set(tok.eos_token_ids)
    for i, prompt in enumerate(prompts):
        expected = naive_beam_search(scorer, prompt, params, ends)
        assert got[str(i)] == expected, (i, got[str(i)], expected)
        assert len(got[str(i)]) == n
    stats = engine.stats()
    assert stats.num_blocks_used == 0 and stats.num_blocks_free == stats.num_blocks_total


def test_stop_tokens_end_hypotheses(tiny_model):
    """A stop token among the best continuations finishes hypotheses ("stop") before the
    length does: the stop token is the best first continuation of the first prompt."""
    engine = make(tiny_model)
    tok = engine.tokenizer
    prompt = tok.encode(PROMPTS[0])
    scorer = make(tiny_model, enable_prefix_caching=False)
    first = max(next_logprobs(scorer, prompt, 4).items(), key=lambda kv: kv[1])[0]
    params = SamplingParams(n=2, use_beam_search=True, max_tokens=5, stop_token_ids=[first],
                            temperature=0)  # fmt: skip
    got = engine_beam_search(engine, [prompt], params)["0"]
    expected = naive_beam_search(scorer, prompt, params, set(tok.eos_token_ids) | {first})
    assert got == expected
    assert any(reason == "stop" for _, reason in got)


def test_beams_share_blocks_and_fork(tiny_model):
    """While beams run, their prompt blocks are shared: fewer blocks are used than the beams
    would hold apart, and more than one sequence runs for the request."""
    engine = make(tiny_model)
    tok = engine.tokenizer
    prompt = tok.encode("A long enough prompt to fill several blocks of four tokens each")
    engine.add_request("a", prompt, SamplingParams(use_beam_search=True, n=4, max_tokens=8))
    most_beams = 0
    while engine.has_unfinished():
        engine.step()
        request = engine.requests.get("a")
        if request is None:
            break
        live = [s for s in request.sequences if not s.is_finished]
        most_beams = max(most_beams, len(live))
        if len(live) == 4:
            apart = sum(len(s.block_table) for s in live)
            assert engine.stats().num_blocks_used < apart
    assert most_beams == 4
    assert engine.stats().num_blocks_used == 0


def test_a_small_pool_preempts_beams_and_keeps_the_answer(tiny_model):
    engine = make(tiny_model, num_blocks=24)
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, max_tokens=10)
    small = engine_beam_search(engine, prompts, params)
    assert engine.stats().num_preemptions > 0
    assert small == engine_beam_search(make(tiny_model), prompts, params)
    assert engine.stats().num_blocks_used == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 3, "best_of": 2}, r"best_of \(2\) must be at least n \(3\)"),
        ({"stop": ["x"]}, "beam search does not take stop"),
        ({"logprobs": 1, "min_tokens": 1}, "beam search does not take logprobs, min_tokens"),
        ({"use_beam_search": "yes"}, "use_beam_search must be true or false"),
        ({"use_beam_search": False, "best_of": 2}, "best_of above 1 needs use_beam_search"),
        ({"best_of": 0}, "best_of must be at least 1"),
        ({"length_penalty": float("nan")}, "length_penalty must be a finite number"),
    ],
)
def test_beam_search_parameters_are_checked(fields, message):
    with pytest.raises(EngineConfigError, match=message):
        SamplingParams(**{"use_beam_search": True, "max_tokens": 4, **fields})


def test_beam_width_beyond_max_num_seqs_is_refused(tiny_model):
    engine = make(tiny_model, max_num_seqs=3)
    params = SamplingParams(n=1, best_of=4, use_beam_search=True)
    with pytest.raises(EngineError, match="beam width is 4; this engine runs at most 3"):
        engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [5, 6, 7], SamplingParams(best_of=3, use_beam_search=True))


def test_beam_search_never_speculates():
    assert SamplingParams(use_beam_search=True).speculative is False
