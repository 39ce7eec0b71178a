"""Two-run statistics: hand-worked statistics, analytic bootstrap intervals, Mann-Whitney U."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slo.comparison import (
    Sample,
    Statistic,
    _bootstrap_groups,
    bootstrap_ratio,
    mann_whitney,
    weighted_statistic,
)


@pytest.mark.parametrize(
    ("statistic", "values", "window_s", "expected"),
    [
        (Statistic("rate"), [1.0, 2.0, 3.0], 2.0, 3.0),
        (Statistic("mean"), [1.0, 2.0, 6.0], 1.0, 3.0),
        (Statistic("quantile", 0.5), [4.0, 1.0, 3.0, 2.0], 1.0, 2.5),
        # linear interpolation: position 0.9 * 9 = 8.1 between 9 and 10
        (Statistic("quantile", 0.9), list(range(1, 11)), 1.0, 9.1),
        (Statistic("rate"), [], 5.0, 0.0),
    ],
)
def test_statistic_hand_cases(statistic, values, window_s, expected):
    assert statistic.compute(np.array(values, dtype=float), window_s) == pytest.approx(expected)


def test_min_samples_for_tail_quantiles():
    assert Statistic("quantile", 0.99).min_samples(20) == 100
    assert Statistic("quantile", 0.5).min_samples(20) == 20
    assert Statistic("rate").min_samples(5) == 5


def test_invalid_inputs_are_refused():
    with pytest.raises(ValueError):
        Statistic("median")
    with pytest.raises(ValueError):
        Statistic("quantile")
    with pytest.raises(ValueError):
        Sample(np.array([1.0, np.nan]), 1.0)
    with pytest.raises(ValueError):
        Sample(np.array([1.0]), 0.0)


def test_constant_samples_give_exact_ratio_and_degenerate_interval():
    rng = np.random.default_rng(0)
    base = [Sample(np.full(50, 10.0), 1.0)]
    cand = [Sample(np.full(50, 12.0), 1.0)]
    est = bootstrap_ratio(base, cand, Statistic("quantile", 0.5), rng=rng, n_resamples=200)
    assert (est.baseline, est.candidate) == (10.0, 12.0)
    assert est.ratio == pytest.approx(1.2)
    assert est.ci_low == pytest.approx(1.2) and est.ci_high == pytest.approx(1.2)
    assert est.resampled_baseline == est.resampled_candidate == "requests"


def test_mean_ratio_interval_matches_normal_theory():
    # Baseline constant 10; candidate ~ N(12, 1), n = 400: the ratio's 95% interval is
    # mean/10 +- 1.96 * sd / sqrt(n) / 10 by the central limit theorem.
    gen = np.random.default_rng(1)
    cand_values = gen.normal(12.0, 1.0, size=400)
    est = bootstrap_ratio(
        [Sample(np.full(400, 10.0), 1.0)],
        [Sample(cand_values, 1.0)],
        Statistic("mean"),
        rng=np.random.default_rng(2),
        n_resamples=4000,
    )
    half_width = 1.96 * cand_values.std(ddof=1) / math.sqrt(400) / 10.0
    assert est.ratio == pytest.approx(cand_values.mean() / 10.0)
    assert est.ci_low == pytest.approx(est.ratio - half_width, abs=0.003)
    assert est.ci_high == pytest.approx(est.ratio + half_width, abs=0.003)


def test_same_seed_same_interval():
    gen = np.random.default_rng(3)
    base = [Sample(gen.lognormal(0, 0.5, 200), 10.0)]
    cand = [Sample(gen.lognormal(0.1, 0.5, 200), 10.0)]
    stat = Statistic("quantile", 0.99)
    a = bootstrap_ratio(base, cand, stat, rng=np.random.default_rng(7), n_resamples=300)
    b = bootstrap_ratio(base, cand, stat, rng=np.random.default_rng(7), n_resamples=300)
    assert a == b


def test_whole_runs_are_resampled_when_repetitions_exist():
    # Three baseline runs whose rates are 1, 2 and 3 per second: any bootstrap replicate of
    # pooled rate lies in [1, 3], and the point estimate is the pooled rate 6 / 3 = 2.
    base = [Sample(np.full(10, 1.0), 10.0), Sample(np.full(20, 1.0), 10.0)]
    base.append(Sample(np.full(30, 1.0), 10.0))
    cand = [Sample(np.full(20, 1.0), 10.0)] * 3
    est = bootstrap_ratio(base, cand, Statistic("rate"), rng=np.random.default_rng(0))
    assert est.resampled_baseline == "runs" and est.runs_baseline == 3
    assert est.baseline == pytest.approx(2.0) and est.candidate == pytest.approx(2.0)
    assert est.ratio == pytest.approx(1.0)
    assert 2 / 3 - 1e-9 <= est.ci_low < 1.0 < est.ci_high <= 2.0 + 1e-9


def test_zero_baseline_gives_nan_ratio():
    est = bootstrap_ratio(
        [Sample(np.zeros(5), 1.0)],
        [Sample(np.ones(5), 1.0)],
        Statistic("rate"),
        rng=np.random.default_rng(0),
        n_resamples=50,
    )
    assert math.isnan(est.ratio) and math.isnan(est.ci_low)


def test_mann_whitney_hand_case():
    # Candidate entirely above baseline: U = 3 * 3 = 9; exact two-sided p = 2 / C(6, 3) = 0.1.
    result = mann_whitney(np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0, 6.0]), min_n=3)
    assert result is not None
    assert result.u == 9.0
    assert result.p_value == pytest.approx(0.1)


def test_mann_whitney_declines_when_samples_do_not_allow():
    assert mann_whitney(np.arange(5.0), np.arange(5.0), min_n=8) is None
    assert mann_whitney(np.ones(20), np.ones(20)) is None


@settings(max_examples=30, deadline=None)
@given(
    values=st.lists(st.floats(0.1, 1e4), min_size=1, max_size=40),
    scale=st.floats(0.25, 4.0),
    q=st.sampled_from([0.5, 0.9, 0.99]),
)
def test_scaling_the_candidate_scales_the_ratio(values, scale, q):
    # Quantiles are scale-equivariant, so candidate = scale * baseline gives ratio == scale.
    base = np.array(values)
    est = bootstrap_ratio(
        [Sample(base, 1.0)],
        [Sample(base * scale, 1.0)],
        Statistic("quantile", q),
        rng=np.random.default_rng(0),
        n_resamples=20,
    )
    assert est.ratio == pytest.approx(scale, rel=1e-9)
    assert est.ci_low <= est.ci_high


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.floats(0.0, 1e3), st.integers(0, 4)), min_size=1, max_size=30
    ).filter(lambda pairs: sum(w for _, w in pairs) > 0),
    kind=st.sampled_from(["q0", "q0.5", "q0.9", "q0.99", "q1", "mean", "rate"]),
)
def test_weighted_statistic_equals_statistic_of_repeated_values(data, kind):
    # Independent implementation: build the repeated array and use numpy directly.
    pairs = sorted(data)
    values = np.array([v for v, _ in pairs])
    weights = np.array([[w for _, w in pairs]])
    repeated = np.repeat(values, weights[0])
    if kind == "mean":
        statistic, expected = Statistic("mean"), repeated.mean()
    elif kind == "rate":
        statistic, expected = Statistic("rate"), repeated.sum() / 2.0
    else:
        q = float(kind[1:])
        statistic, expected = Statistic("quantile", q), np.quantile(repeated, q)
    got = weighted_statistic(statistic, values, weights, 2.0)[0]
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_grouped_values_are_resampled_together():
    # Request A has gaps [1, 1, 1], request B has [3]. Resampling requests gives only the
    # pools AA (mean 1), AB (mean 1.5) and BB (mean 3); resampling gaps would also give
    # e.g. [1, 3, 3, 1] (mean 2).
    sample = Sample(np.array([1.0, 3.0, 1.0, 1.0]), 1.0, groups=np.array([7, 9, 7, 7]))
    assert sample.n_units == 2
    replicates = _bootstrap_groups(sample, Statistic("mean"), np.random.default_rng(0), 300)
    assert set(np.round(replicates, 9)) == {1.0, 1.5, 3.0}


def test_group_labels_must_match_values():
    with pytest.raises(ValueError):
        Sample(np.array([1.0, 2.0]), 1.0, groups=np.array([0]))
