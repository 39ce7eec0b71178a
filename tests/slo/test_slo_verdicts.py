"""Verdicts: early-stopping pass/fail/inconclusive, min_samples gating, overall verdict."""

from __future__ import annotations

import numpy as np
import pytest
from slo_runs import request_metrics

from slo.spec import PercentileObjective, SLOSpec
from slo.verdicts import evaluate, overall_verdict

MS = 1_000_000


def ttft_run(ttfts_ms: list[float], statuses: list[str] | None = None):
    statuses = statuses or ["ok"] * len(ttfts_ms)
    rows = []
    for i, (ttft, status) in enumerate(zip(ttfts_ms, statuses, strict=True)):
        sent = i * 10 * MS
        rows.append(dict(request_id=f"r{i}", t_sent_ns=sent, t_first_token_ns=sent + round(ttft * MS),
                         t_last_token_ns=sent + round(ttft * MS), t_done_ns=sent + round(ttft * MS) + MS,
                         status=status, output_tokens=1, input_tokens=10))  # fmt: skip
    return request_metrics(rows, [])


P99_TTFT = SLOSpec(name="t", percentiles=(PercentileObjective("ttft_ms", 99, 1000),))


def only(result: dict) -> dict:
    (objective,) = result["objectives"]
    return objective


@pytest.mark.parametrize(("n", "verdict"), [(459, "pass"), (458, "inconclusive")])
def test_p99_needs_459_clean_samples(n, verdict):
    o = only(evaluate(ttft_run([10.0] * n), P99_TTFT, rng=np.random.default_rng(0)))
    assert o["verdict"] == verdict
    assert o["measured"] == pytest.approx(10.0)
    assert o["ci"] == [pytest.approx(10.0), pytest.approx(10.0)]
    assert (o["n"], o["n_bad"]) == (n, 0)


def test_many_over_the_limit_fails():
    values = [10.0] * 90 + [5000.0] * 10
    o = only(evaluate(ttft_run(values), P99_TTFT, rng=np.random.default_rng(0)))
    assert o["verdict"] == "fail" and o["n_bad"] == 10
    assert o["measured"] == pytest.approx(5000.0)
    assert o["ci"][1] == pytest.approx(5000.0)


def test_min_samples_makes_it_inconclusive():
    spec = SLOSpec(name="t", percentiles=P99_TTFT.percentiles, min_samples=500)
    o = only(evaluate(ttft_run([10.0] * 459), spec, rng=np.random.default_rng(0)))
    assert o["verdict"] == "inconclusive" and "min_samples 500" in o["reason"]


def test_min_samples_does_not_hide_a_proven_failure():
    spec = SLOSpec(name="t", percentiles=P99_TTFT.percentiles, min_samples=500)
    # 30 of 64 over a p99 limit: P(X >= 30; 64, 0.01) is astronomically small, so it fails.
    o = only(evaluate(ttft_run([10.0] * 34 + [5000.0] * 30), spec, rng=np.random.default_rng(0)))
    assert o["verdict"] == "fail" and o["n"] == 64


def test_percentiles_judged_over_ok_requests_error_rate_over_all():
    statuses = ["ok"] * 995 + ["error"] * 5
    spec = SLOSpec(name="t", percentiles=P99_TTFT.percentiles, error_rate_max=0.01)
    result = evaluate(ttft_run([10.0] * 1000, statuses), spec, rng=np.random.default_rng(0))
    percentile, error_rate = result["objectives"]
    assert percentile["n"] == 995 and percentile["verdict"] == "pass"
    assert error_rate["measured"] == pytest.approx(0.005) and error_rate["n_bad"] == 5
    # 5 errors in 1000 at 1% allowed: P(X <= 5; 1000, 0.01) ~ 0.067 > 0.01, so not proven
    assert error_rate["verdict"] == "inconclusive"
    assert result["verdict"] == "inconclusive"


def test_overall_verdict():
    assert overall_verdict([]) == "inconclusive"  # nothing judged
    assert overall_verdict(["pass", "inconclusive"]) == "inconclusive"
    assert overall_verdict(["inconclusive", "fail", "pass"]) == "fail"


def test_verdicts_repeat_with_the_same_seed():
    values = list(np.random.default_rng(3).exponential(100, size=300))
    a = evaluate(ttft_run(values), P99_TTFT, rng=np.random.default_rng(11))
    b = evaluate(ttft_run(values), P99_TTFT, rng=np.random.default_rng(11))
    assert a == b


def test_why_is_said_in_words():
    from slo.verdicts import rate_verdict

    spec = SLOSpec(name="t", attainment_min=0.99)
    bad = np.array([True] * 26 + [False] * 14)
    v = rate_verdict(name="attainment >= 99% of requests", kind="attainment", bad=bad,
                     allowed=0.01, measured_good=True, spec=spec,
                     rng=np.random.default_rng(0))  # fmt: skip
    assert v["verdict"] == "fail"
    assert v["reason"] == "26 of 40 requests missed; at most 1% may"


def test_objective_names_carry_units(hand_run):
    import slo

    spec = {"name": "u", "percentiles": [{"metric": "ttft_ms", "percentile": 99, "max_ms": 200}],
            "attainment_min": 0.99, "error_rate_max": 0.01, "per_request": {"ttft_ms": 200}}  # fmt: skip
    names = [o["name"] for o in slo.summarize(hand_run, spec)["slo"]["objectives"]]
    assert names == ["ttft_ms p99 <= 200 ms", "attainment >= 99% of requests",
                     "error_rate <= 1% of requests"]  # fmt: skip


@pytest.mark.parametrize(
    ("n_bad", "allowed", "confidence", "expected"),
    [
        # 0.99^459 = 0.00992 <= 0.01 < 0.99^458 = 0.01002: MLPerf's 459.
        (0, 0.01, 0.99, 459),
        # 0.95^90 = 0.00989 <= 0.01 < 0.95^89 = 0.01041.
        (0, 0.05, 0.99, 90),
        # One miss: P(X <= 1; 662, 0.01) = 0.99^662 + 662 * 0.01 * 0.99^661 = 0.009914 <= 0.01,
        # and at 661 it is 0.010001.
        (1, 0.01, 0.99, 662),
        (0, 0.0, 0.99, 1),  # a zero allowance passes on no miss at any size...
        (1, 0.0, 0.99, None),  # ...and no size passes one miss
        (3, 1.0, 0.99, 3),  # everything allowed
    ],
)
def test_samples_to_pass_by_hand(n_bad, allowed, confidence, expected):
    from slo.stats import samples_to_pass

    assert samples_to_pass(n_bad, allowed, confidence) == expected


def test_an_inconclusive_verdict_says_how_many_samples_would_decide_it():
    """The flagship run's case: 64 clean samples of a p99 objective cannot pass; the verdict
    names the 459 that would (395 more), never fewer than min_samples."""
    o = only(evaluate(ttft_run([10.0] * 64), P99_TTFT, rng=np.random.default_rng(0)))
    assert o["verdict"] == "inconclusive" and o["samples_to_pass"] == 459
    assert o["reason"].endswith("459 samples with no further miss would pass (395 more)")
    spec = SLOSpec(name="t", percentiles=P99_TTFT.percentiles, min_samples=500)
    o = only(evaluate(ttft_run([10.0] * 459), spec, rng=np.random.default_rng(0)))
    assert o["samples_to_pass"] == 500 and "(41 more)" in o["reason"]
    passed = only(evaluate(ttft_run([10.0] * 459), P99_TTFT, rng=np.random.default_rng(0)))
    assert passed["verdict"] == "pass" and passed["samples_to_pass"] is None
    assert "would pass" not in passed["reason"]
