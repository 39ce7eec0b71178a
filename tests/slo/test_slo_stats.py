"""Bootstrap intervals and the binomial early-stopping bound."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slo.stats import (
    binomial_verdict,
    bootstrap_proportion_ci,
    bootstrap_quantile_ci,
    early_stopping_min_passing,
)


def binom_cdf_by_hand(t: int, n: int, bad: float) -> float:
    return sum(math.comb(n, x) * bad**x * (1 - bad) ** (n - x) for x in range(t + 1))


@pytest.mark.parametrize(
    ("overlatency", "percentile", "confidence", "expected"),
    [
        (0, 0.99, 0.99, 459),  # ceil(ln 0.01 / ln 0.99) = ceil(458.2)
        (2, 0.90, 0.95, 59),
    ],
)
def test_early_stopping_matches_hand_binomial(overlatency, percentile, confidence, expected):
    # the hand computation: smallest h with P(X <= t; h + t, 1 - p) <= 1 - c
    h = 0
    while binom_cdf_by_hand(overlatency, h + overlatency, 1 - percentile) > 1 - confidence:
        h += 1
    assert h == expected
    assert early_stopping_min_passing(overlatency, percentile, confidence) == expected
    assert (
        binom_cdf_by_hand(overlatency, expected - 1 + overlatency, 1 - percentile) > 1 - confidence
    )


def test_binomial_verdict_thresholds():
    # p99 at 99% confidence with no sample over the limit: 459 samples pass, 458 do not
    assert binomial_verdict(0, 459, 0.01, 0.99) == "pass"
    assert binomial_verdict(0, 458, 0.01, 0.99) == "inconclusive"
    # 10 of 100 over a 1% allowance: P(X >= 10; 100, 0.01) is about 7e-8
    assert binomial_verdict(10, 100, 0.01, 0.99) == "fail"
    assert binomial_verdict(1, 100, 0.01, 0.99) == "inconclusive"
    assert binomial_verdict(0, 0, 0.01, 0.99) == "inconclusive"
    assert binomial_verdict(0, 3, 0.0, 0.99) == "pass"
    assert binomial_verdict(1, 3, 0.0, 0.99) == "fail"


def test_bootstrap_is_seeded_and_brackets_the_estimate():
    values = np.random.default_rng(1).exponential(size=300)
    a = bootstrap_quantile_ci(values, 90, rng=np.random.default_rng(7))
    b = bootstrap_quantile_ci(values, 90, rng=np.random.default_rng(7))
    assert a == b
    assert a[0] < np.percentile(values, 90) < a[1]
    assert bootstrap_quantile_ci(np.array([np.nan]), 50, rng=np.random.default_rng(0)) is None
    assert bootstrap_quantile_ci(np.array([4.0]), 50, rng=np.random.default_rng(0)) == (4.0, 4.0)
    low, high = bootstrap_proportion_ci(
        np.array([True] * 90 + [False] * 10), rng=np.random.default_rng(0)
    )
    assert low < 0.9 < high


@pytest.mark.parametrize(("percentile", "true_value"), [(50, math.log(2)), (90, math.log(10))])
def test_bootstrap_coverage_near_nominal(percentile, true_value):
    # Exponential(1): the q-quantile is -ln(1 - q). 200 seeded trials of n = 300.
    rng = np.random.default_rng(2024)
    trials = 200
    covered = 0
    for _ in range(trials):
        sample = rng.exponential(size=300)
        low, high = bootstrap_quantile_ci(sample, percentile, rng=rng, n_resamples=500)
        covered += low <= true_value <= high
    assert 0.90 <= covered / trials <= 0.99


@pytest.mark.parametrize("percentile", [50, 90, 95])
def test_order_statistic_shortcut_matches_direct_resampling(percentile):
    values = np.random.default_rng(5).exponential(size=4000)
    direct = bootstrap_quantile_ci(
        values, percentile, rng=np.random.default_rng(1), n_resamples=4000, direct_limit=10**12
    )
    shortcut = bootstrap_quantile_ci(
        values, percentile, rng=np.random.default_rng(2), n_resamples=4000, direct_limit=0
    )
    width = direct[1] - direct[0]
    assert shortcut[0] == pytest.approx(direct[0], abs=0.1 * width)
    assert shortcut[1] == pytest.approx(direct[1], abs=0.1 * width)


def test_proportion_interval_matches_resampling_the_flags():
    flags = np.random.default_rng(6).random(2000) < 0.9
    low, high = bootstrap_proportion_ci(flags, rng=np.random.default_rng(1), n_resamples=4000)
    resampled = flags[np.random.default_rng(2).integers(0, flags.size, (4000, flags.size))].mean(
        axis=1
    )
    ref_low, ref_high = np.quantile(resampled, [0.025, 0.975])
    assert low == pytest.approx(ref_low, abs=0.004) and high == pytest.approx(ref_high, abs=0.004)
