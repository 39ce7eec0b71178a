"""Admission mirrors what a step can execute: every SamplingParams field (and add_request's
priority) at the extremes of its type is either rejected in one sentence when the request is
built or added, or accepted and then served to the end beside a well-formed greedy request
whose output it leaves unchanged. Also: tiny temperatures are greedy, and the limits on stop
strings and stop token ids."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine_ref import (
    EngineConfig,
    EngineConfigError,
    EngineError,
    LLMEngine,
    SamplingParams,
)
from engine_ref.core.engine_config import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

VOCAB = 512  # tiny-random
MAX_MODEL_LEN = 48
PROMPT = [17, 42, 99, 7, 256, 311, 5, 88, 123, 64]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
EXTREMES = [0, -1, 2**31, 2**63, 2**64, 1e20, math.nan, math.inf, -math.inf, 5e-324]
EXTREME_IDS = ["0", "-1", "2^31", "2^63", "2^64", "1e20", "nan", "inf", "-inf", "5e-324"]

# For each field, the extremes accepted (the others must be rejected). Integer fields reject
# every float; ints beyond what a step can use are either clamped by the context (max_tokens)
# or mean "off" (top_k beyond the vocabulary).
ACCEPTED = {
    "n": set(),  # 0 and below are invalid, 2^31 and up exceed max_num_seqs, floats are not ints
    "max_tokens": {"2^31", "2^63", "2^64"},  # generation ends at max_model_len
    "temperature": {"0", "2^31", "2^63", "2^64", "1e20", "5e-324"},
    "top_k": {"0", "-1", "2^31", "2^63", "2^64"},
    "top_p": {"5e-324"},  # keeps the single most likely token
    "seed": {"0", "-1", "2^31"},  # int64
    "logprobs": {"0"},
    "min_tokens": {"0"},  # at most max_tokens (16 by default)
    "stop_token_ids": {"0"},  # ids must be in the vocabulary
    "priority": {"0", "-1", "2^31", "2^63", "2^64"},
}

EXTRA_CASES = [
    # (id, SamplingParams kwargs, add_request kwargs, accepted)
    ("n-at-max_num_seqs", dict(n=4, temperature=1.0, seed=3), {}, True),
    ("n-above-max_num_seqs", dict(n=5), {}, False),
    ("seed-int64-max-with-children", dict(n=3, seed=2**63 - 1), {}, True),
    ("seed-int64-min", dict(seed=-(2**63)), {}, True),
    ("seed-below-int64", dict(seed=-(2**63) - 1), {}, False),
    ("min_tokens-huge-with-max_tokens", dict(min_tokens=2**40, max_tokens=2**40), {}, True),
    ("top_k-vocab", dict(top_k=VOCAB), {}, True),
    ("top_k-vocab-plus-1", dict(top_k=VOCAB + 1, temperature=0.5), {}, True),
    ("logprobs-max", dict(logprobs=20), {}, True),
    ("logprobs-above-max", dict(logprobs=21), {}, False),
    ("stop_token_id-last", dict(stop_token_ids=[VOCAB - 1], min_tokens=3), {}, True),
    ("stop_token_id-vocab", dict(stop_token_ids=[VOCAB], min_tokens=3), {}, False),
    ("stop_token_id-float", dict(stop_token_ids=[3.0]), {}, False),
    ("stop-str", dict(stop="zz"), {}, True),
    ("stop-empty-string", dict(stop=[""]), {}, False),
    ("stop-not-a-string", dict(stop=[5]), {}, False),
    ("stop-number", dict(stop=5), {}, False),
    ("ignore_eos-string", dict(ignore_eos="false"), {}, False),
    ("ignore_eos-numpy", dict(ignore_eos=np.bool_(True)), {}, True),
    ("max_tokens-numpy", dict(max_tokens=np.int64(5)), {}, True),
    ("temperature-numpy", dict(temperature=np.float32(0.7), seed=1), {}, True),
    ("temperature-float32-overflow", dict(temperature=1e300), {}, True),
    ("temperature-bigint", dict(temperature=10**400), {}, False),
    ("temperature-tiny-top_p-tiny", dict(temperature=1e-30, top_p=5e-324), {}, True),
    ("n-bool", dict(n=True), {}, False),
    ("priority-string", {}, dict(priority="high"), False),
    ("cache_salt-empty", {}, dict(cache_salt=""), False),
    ("cache_salt-not-a-string", {}, dict(cache_salt=5), False),
]


def make(tiny_model, **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=64,
                   num_threads=1, max_model_len=MAX_MODEL_LEN, max_num_seqs=4)  # fmt: skip
    options.update(overrides)
    return LLMEngine(EngineConfig(**options), loaded=tiny_model)


def drain(engine: LLMEngine) -> dict[str, dict]:
    """{request_id: {"tokens": [...], "reasons": {index: finish_reason}, "error": ...}}"""
    results: dict[str, dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "reasons": {}, "error": None})
            for c in out.outputs:
                if c.index == 0:
                    r["tokens"] += c.new_token_ids
                r["reasons"][c.index] = c.finish_reason
                for lp in c.logprobs or []:
                    assert all(math.isfinite(v) for v in lp.values())
            r["error"] = out.error
    return results


@pytest.fixture(scope="module")
def baseline(tiny_model) -> list[int]:
    engine = make(tiny_model)
    engine.add_request("good", PROMPT, GREEDY)
    return drain(engine)["good"]["tokens"]


def serve_beside_greedy(tiny_model, params_kwargs: dict, add_kwargs: dict) -> tuple[bool, dict]:
    """Try the odd request beside a greedy one; returns (accepted, results)."""
    engine = make(tiny_model)
    engine.add_request("good", PROMPT, GREEDY)
    try:
        params = SamplingParams(**params_kwargs)
        engine.add_request("odd", PROMPT[::-1], params, **add_kwargs)
    except (EngineConfigError, EngineError) as exc:
        message = str(exc)
        assert message.endswith(".") and "\n" not in message and message.count(". ") == 0
        accepted = False
    else:
        accepted = True
    results = drain(engine)
    stats = engine.stats()
    assert stats.num_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    return accepted, results


def check(results: dict, baseline: list[int], accepted: bool) -> None:
    assert results["good"]["tokens"] == baseline and results["good"]["error"] is None
    if accepted:
        odd = results["odd"]
        assert odd["error"] is None
        assert odd["reasons"] and set(odd["reasons"].values()) <= {"stop", "length"}
    else:
        assert "odd" not in results


FIELD_CASES = [
    pytest.param(name, value, label in accepted, id=f"{name}={label}")
    for name, accepted in ACCEPTED.items()
    for value, label in zip(EXTREMES, EXTREME_IDS, strict=True)
]


@pytest.mark.parametrize("name, value, expect_accepted", FIELD_CASES)
def test_numeric_extremes_are_rejected_or_served(
    tiny_model, baseline, name, value, expect_accepted
):
    params_kwargs: dict = {}
    add_kwargs: dict = {}
    if name == "priority":
        add_kwargs["priority"] = value
    elif name == "stop_token_ids":
        params_kwargs["stop_token_ids"] = [value]
    else:
        params_kwargs[name] = value
    accepted, results = serve_beside_greedy(tiny_model, params_kwargs, add_kwargs)
    assert accepted == expect_accepted
    check(results, baseline, accepted)


@pytest.mark.parametrize(
    "params_kwargs, add_kwargs, expect_accepted",
    [pytest.param(p, a, ok, id=case_id) for case_id, p, a, ok in EXTRA_CASES],
)
def test_edge_values_are_rejected_or_served(
    tiny_model, baseline, params_kwargs, add_kwargs, expect_accepted
):
    accepted, results = serve_beside_greedy(tiny_model, params_kwargs, add_kwargs)
    assert accepted == expect_accepted
    check(results, baseline, accepted)


def test_huge_max_tokens_ends_at_the_context(tiny_model):
    engine = make(tiny_model)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=2**64, ignore_eos=True, seed=1))
    out = drain(engine)["a"]
    assert out["reasons"] == {0: "length"}
    assert len(out["tokens"]) == MAX_MODEL_LEN - len(PROMPT)


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 5e-324])
def test_tiny_temperature_is_greedy(tiny_model, baseline, temperature):
    engine = make(tiny_model)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=5, ignore_eos=True)
    assert params.is_greedy
    engine.add_request("tiny", PROMPT, params)
    assert drain(engine)["tiny"]["tokens"] == baseline


def test_temperature_at_the_greedy_threshold_samples(tiny_model):
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert SamplingParams(temperature=0.99e-5).is_greedy


@pytest.mark.parametrize("temperature", [1e20, 1e300])
def test_huge_temperature_samples_without_nan(tiny_model, baseline, temperature):
    engine = make(tiny_model)
    engine.add_request("good", PROMPT, GREEDY)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=5, ignore_eos=True,
                            min_tokens=6, stop_token_ids=[1], logprobs=2)  # fmt: skip
    engine.add_request("hot", PROMPT, params)
    out = drain(engine)
    assert out["good"]["tokens"] == baseline
    hot = out["hot"]["tokens"]
    assert len(hot) == 12 and all(0 <= t < VOCAB for t in hot)
    assert len(set(hot)) > 6  # near-uniform over 512 tokens, not one repeated (NaN) pick


# -- limits on stop strings and stop token ids -------------------------------------------------
def stop_strings(count: int, length: int) -> list[str]:
    return [f"{i:04d}".ljust(length, "~") for i in range(count)]


@pytest.mark.parametrize(
    "count, length, accepted",
    [
        (MAX_STOP_STRINGS - 1, 8, True),
        (MAX_STOP_STRINGS, 8, True),
        (MAX_STOP_STRINGS + 1, 8, False),
        (1, MAX_STOP_STRING_CHARS - 1, True),
        (1, MAX_STOP_STRING_CHARS, True),
        (1, MAX_STOP_STRING_CHARS + 1, False),
        (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, True),
        (500_000, 4, False),
    ],
)
def test_stop_string_limits(tiny_model, baseline, count, length, accepted):
    stop = stop_strings(count, length)
    if not accepted:
        limit = MAX_STOP_STRINGS if count > MAX_STOP_STRINGS else MAX_STOP_STRING_CHARS
        with pytest.raises(EngineConfigError, match=f"at most {limit} "):
            SamplingParams(stop=stop)
        return
    got, results = serve_beside_greedy(tiny_model, dict(stop=stop, seed=2), {})
    assert got
    check(results, baseline, accepted=True)


@pytest.mark.parametrize(
    "count", [MAX_STOP_TOKEN_IDS - 1, MAX_STOP_TOKEN_IDS, MAX_STOP_TOKEN_IDS + 1]
)
def test_stop_token_id_limit(tiny_model, baseline, count):
    ids = list(range(VOCAB - count, VOCAB))
    if count > MAX_STOP_TOKEN_IDS:
        with pytest.raises(EngineConfigError, match=f"at most {MAX_STOP_TOKEN_IDS} "):
            SamplingParams(stop_token_ids=ids)
        return
    params = dict(stop_token_ids=ids, min_tokens=4, seed=2)  # banned while below min_tokens
    accepted, results = serve_beside_greedy(tiny_model, params, {})
    assert accepted
    check(results, baseline, accepted=True)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([True, 5], "must be integers"),  # a bool is not a token id (its type is not int)
        ([5.0, 6], "must be integers"),
        (["5"], "must be integers"),
        (5, "must be integers"),  # not a sequence
        ([], "has no tokens"),
        ([-1, 5], f"in [0, {VOCAB})"),
        ([VOCAB], f"in [0, {VOCAB})"),
        (list(range(MAX_MODEL_LEN)), "at most 47"),  # no room for an output token
    ],
)
def test_a_prompt_of_anything_but_token_ids_is_refused_in_one_sentence(tiny_model, prompt,
                                                                       message):  # fmt: skip
    engine = make(tiny_model)
    with pytest.raises(EngineError, match=message.replace("[", r"\[").replace(")", r"\)")):
        engine.add_request("bad", prompt, GREEDY)
    assert not engine.has_unfinished()


SAME_PROMPTS = {  # the same token ids, each as a caller may hold them
    "numpy int64": lambda: np.array(PROMPT, dtype=np.int64),
    "numpy int32": lambda: np.array(PROMPT, dtype=np.int32),
    "an iterator": lambda: iter(PROMPT),
    "a tuple": lambda: tuple(PROMPT),
}


@pytest.mark.parametrize("kind", list(SAME_PROMPTS))
def test_token_ids_of_any_integer_type_are_served_as_plain_ints(tiny_model, baseline, kind):
    """The prompt check takes plain ints as they are (their type is int) and converts any
    other integer (numpy's); all serve the plain list's tokens."""
    engine = make(tiny_model)
    engine.add_request("r", SAME_PROMPTS[kind](), GREEDY)
    stored = engine.requests["r"].prompt_token_ids
    assert list(stored) == PROMPT and all(type(t) is int for t in stored)
    results = drain(engine)["r"]
    assert results["error"] is None and results["tokens"] == baseline


@pytest.mark.parametrize(
    "prompt", [[VOCAB - 1, 0], list(range(MAX_MODEL_LEN - 1))], ids=["ids at both ends", "longest"]
)
def test_prompts_at_the_limits_are_served(tiny_model, prompt):
    engine = make(tiny_model)
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0))
    assert drain(engine)["r"]["error"] is None
