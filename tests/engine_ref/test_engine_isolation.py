"""Failure isolation through `LLMEngine.step`: when a step raises (in the forward, in sampling,
or while appending a request's tokens), only the request that causes it fails, with
finish_reason "error" and `RequestOutput.error`; the others keep exactly the tokens of a run
without it (seeded sampling included), and the block pool returns to idle."""

from __future__ import annotations

import pytest

import engine_ref.core.output_processor as output_processor_module
from engine_ref import EngineConfig, LLMEngine, SamplingParams
from engine_ref.core.isolation import isolate_failures

SENTINEL = 509  # in no prompt or output of the well-formed requests (checked below)
BAD_PROMPT = [(7 * i) % 500 + 3 for i in range(39)] + [SENTINEL]


class FailingModel:
    """The engine's model, raising `RuntimeError("injected fault")` for a batch where
    `fails(input_ids, positions)` holds; `after_forward` runs the forward first, so the failed
    attempt has written KV for every row."""

    def __init__(self, model, fails, *, after_forward: bool = False) -> None:
        self.model = model
        self.fails = fails
        self.after_forward = after_forward
        self.num_failures = 0

    def __call__(self, input_ids, positions, meta, kv_caches):
        hidden = self.model(input_ids, positions, meta, kv_caches) if self.after_forward else None
        if self.fails(input_ids, positions):
            self.num_failures += 1
            raise RuntimeError("injected fault\nsecond line of the message")
        return hidden if hidden is not None else self.model(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


class FailingTokenizer:
    """The engine's tokenizer, whose decode raises when the sentinel is among the ids."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids, **kwargs):
        if SENTINEL in ids:
            raise KeyError(SENTINEL)
        return self.tokenizer.decode(ids, **kwargs)


def make(tiny_model, **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=96,
                   num_threads=1, block_size=4, max_num_batched_tokens=16)  # fmt: skip
    options.update(overrides)
    return LLMEngine(EngineConfig(**options), loaded=tiny_model)


def well_formed() -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy requests sharing a prefix, and seeded ones hot enough (tiny-random's
    distributions are peaked) that every draw of noise matters."""
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    greedy = dict(temperature=0, ignore_eos=True)
    hot = dict(temperature=20.0, ignore_eos=True)
    return {
        "g1": (shared + [40, 41], SamplingParams(max_tokens=12, **greedy)),
        "g2": (shared + [60], SamplingParams(max_tokens=10, **greedy)),
        "s1": ([90, 91, 92, 93, 94], SamplingParams(n=2, max_tokens=10, seed=11, **hot)),
        "s2": ([120, 121, 122], SamplingParams(max_tokens=12, top_k=50, seed=5, logprobs=2, **hot)),
    }


def run(engine: LLMEngine, requests: dict, *, late: dict | None = None, delay_steps: int = 3):
    """Add `requests`, step `delay_steps` times, add `late`, step to the end. Returns
    ({request_id: {index: tokens}}, {request_id: final RequestOutput})."""
    tokens: dict[str, dict[int, list[int]]] = {}
    final = {}

    def collect() -> None:
        for out in engine.step():
            for c in out.outputs:
                tokens.setdefault(out.request_id, {}).setdefault(c.index, [])
                tokens[out.request_id][c.index] += c.new_token_ids
            if out.finished:
                assert out.request_id not in final, "finished twice"
                final[out.request_id] = out

    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    for _ in range(delay_steps):
        collect()
    for request_id, (prompt, params) in (late or {}).items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        collect()
    return tokens, final


def assert_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert not engine.requests and all(r == 0 for r in engine.block_manager.ref_counts)


def assert_failed(out, message: str) -> None:
    assert out.finished and out.error is not None and message in out.error
    assert "\n" not in out.error
    assert out.outputs and all(c.finish_reason == "error" for c in out.outputs)


@pytest.fixture(scope="module")
def baseline(tiny_model):
    tokens, final = run(make(tiny_model), well_formed())
    for per_index in tokens.values():
        assert all(SENTINEL not in t for t in per_index.values())
    assert all(out.error is None for out in final.values())
    return tokens


@pytest.mark.parametrize("after_forward", [False, True], ids=["before", "after-forward"])
def test_a_prompt_that_breaks_the_forward_fails_alone(tiny_model, baseline, after_forward):
    engine = make(tiny_model)
    model = FailingModel(engine.model, lambda ids, _: bool((ids == SENTINEL).any()),
                         after_forward=after_forward)  # fmt: skip
    engine.model = model
    bad = {"bad": (BAD_PROMPT, SamplingParams(max_tokens=5, temperature=0))}
    tokens, final = run(engine, well_formed(), late=bad)
    assert model.num_failures >= 2  # the whole batch, then the bad request alone
    assert_failed(final["bad"], "RuntimeError: injected fault")
    assert final["bad"].outputs[0].num_output_tokens == 0
    assert {k: v for k, v in tokens.items() if k != "bad"} == baseline
    assert all(final[k].error is None for k in baseline)
    assert_idle(engine)


def test_a_request_failing_mid_decode_keeps_what_it_emitted(tiny_model, baseline):
    prompt = BAD_PROMPT[:-1]  # 39 tokens; its 6th output token sits at position 44
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone, _ = run(make(tiny_model), {"long": (prompt, params)})
    engine = make(tiny_model)
    engine.model = FailingModel(engine.model, lambda _, pos: bool((pos >= 44).any()))
    tokens, final = run(engine, well_formed(), late={"long": (prompt, params)})
    assert_failed(final["long"], "injected fault")
    assert tokens["long"][0] == alone["long"][0][:6]
    assert final["long"].outputs[0].num_output_tokens == 6
    assert {k: v for k, v in tokens.items() if k != "long"} == baseline
    assert_idle(engine)


def test_a_sampling_failure_restores_seeded_generators(tiny_model, baseline, monkeypatch):
    """The fault raises after sampling drew from every seeded generator in the batch; the
    retries must draw the same noise, or s1 and s2 would diverge from the baseline."""
    real_sample = output_processor_module.sample
    calls = []

    def sample(logits, rows, generator=None):
        result = real_sample(logits, rows, generator)
        calls.append(len(rows))
        if any(row.params.max_tokens == 13 for row in rows):
            raise ValueError("sampler fault")
        return result

    monkeypatch.setattr(output_processor_module, "sample", sample)
    engine = make(tiny_model)
    marked = {"bad": ([200, 201, 202], SamplingParams(max_tokens=13, temperature=0.5, seed=1))}
    tokens, final = run(engine, well_formed(), late=marked)
    assert_failed(final["bad"], "ValueError: sampler fault")
    assert {k: v for k, v in tokens.items() if k != "bad"} == baseline
    assert_idle(engine)


def test_a_detokenizer_failure_fails_only_that_request(tiny_model, baseline):
    """The failure comes while committing (after the forward and sampling succeeded), for an
    n = 2 request that has just forked: both of its sequences end, their shared blocks free."""
    engine = make(tiny_model)
    engine.tokenizer = FailingTokenizer(engine.tokenizer)
    bad = {"bad": (BAD_PROMPT, SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3))}
    tokens, final = run(engine, well_formed(), late=bad)
    assert_failed(final["bad"], "KeyError: 509")
    assert sorted(c.index for c in final["bad"].outputs) == [0, 1]
    assert {k: v for k, v in tokens.items() if k != "bad"} == baseline
    assert_idle(engine)


def test_a_fault_of_the_whole_batch_only_fails_no_request(tiny_model, baseline):
    """A fault that needs the whole batch (like running out of memory) fails nobody: the
    halves run."""
    engine = make(tiny_model)
    model = FailingModel(engine.model, lambda ids, _: ids.shape[0] > 12)
    engine.model = model
    tokens, final = run(engine, well_formed())
    assert model.num_failures > 0
    assert tokens == baseline and all(out.error is None for out in final.values())
    assert_idle(engine)


def test_when_every_run_fails_every_request_fails_and_the_engine_recovers(tiny_model, baseline):
    engine = make(tiny_model, max_num_batched_tokens=64)  # all four in the first step
    healthy = engine.model
    engine.model = FailingModel(healthy, lambda *_: True)
    for request_id, (prompt, params) in well_formed().items():
        engine.add_request(request_id, prompt, params)
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == sorted(well_formed())
    for out in outs:
        assert_failed(out, "injected fault")
    assert_idle(engine)
    engine.model = healthy
    tokens, _ = run(engine, well_formed())
    assert tokens == baseline
    assert_idle(engine)


def test_isolate_failures_finds_each_failing_unit():
    """Hand-worked: units 0..7, any part holding 2 or 5 fails."""
    runs = []

    def run_part(part):
        runs.append(part)
        if {2, 5} & set(part):
            raise ValueError(f"bad {sorted({2, 5} & set(part))}")
        return part

    results, failures = isolate_failures(list(range(8)), run_part, ValueError("whole"))
    assert results == [[0, 1], [3], [4], [6, 7]]
    assert [(unit, str(exc)) for unit, exc in failures] == [(2, "bad [2]"), (5, "bad [5]")]
    # [0..3] fails: [0, 1] runs, [2, 3] fails: [2] fails, [3] runs; [4..7] fails: [4, 5]
    # fails: [4] runs, [5] fails; [6, 7] runs.
    assert runs == [[0, 1, 2, 3], [0, 1], [2, 3], [2], [3], [4, 5, 6, 7], [4, 5], [4], [5], [6, 7]]


def test_isolate_failures_of_one_unit_reports_the_error():
    error = RuntimeError("x")
    assert isolate_failures(["a"], lambda part: part, error) == ([], [("a", error)])
