"""Means over repetitions and their t-intervals, against hand-worked values."""

from __future__ import annotations

import math

import pytest

from slo.repeats import mean_ci, ratio, t_quantile_975


def test_mean_ci_hand_worked():
    # values 10, 12, 14: mean 12, s = 2, t(0.975, 2) = 4.303, half = 4.303 * 2 / sqrt(3)
    out = mean_ci([10.0, 12.0, 14.0])
    half = 4.303 * 2 / math.sqrt(3)
    assert out["n"] == 3 and out["mean"] == 12.0
    assert out["ci_low"] == pytest.approx(12 - half) and out["ci_high"] == pytest.approx(12 + half)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], {"n": 0, "mean": None, "ci_low": None, "ci_high": None}),
        ([None, float("nan")], {"n": 0, "mean": None, "ci_low": None, "ci_high": None}),
        ([5.0], {"n": 1, "mean": 5.0, "ci_low": None, "ci_high": None}),
        ([5.0, None, 5.0], {"n": 2, "mean": 5.0, "ci_low": 5.0, "ci_high": 5.0}),
    ],
)
def test_mean_ci_edges(values, expected):
    assert mean_ci(values) == expected


def test_t_quantiles_at_the_table_edges():
    assert t_quantile_975(1) == 12.706
    assert t_quantile_975(30) == 2.042
    assert t_quantile_975(31) == 1.96
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_ratio():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None and ratio(1.0, None) is None
