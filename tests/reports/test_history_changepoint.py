"""E-divisive means (`reports.history.changepoint`) against hand-worked cases and a brute-force
computation written straight from the paper's definition (loops over pairs, no prefix sums)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from reports.history import changepoint
from reports.history.changepoint import e_divisive, energy_q


def brute_q(z, tau: int, exponent: float = 1.0) -> float:
    """Q of the split z[:tau] | z[tau:] by Matteson and James (2014), eq. (3)-(4), pair by pair."""
    x, y = list(z[:tau]), list(z[tau:])
    m, k = len(x), len(y)
    between = sum(abs(a - b) ** exponent for a in x for b in y) / (m * k)
    within_x = sum(abs(a - b) ** exponent for a, b in itertools.combinations(x, 2)) / math.comb(
        m, 2
    )
    within_y = sum(abs(a - b) ** exponent for a, b in itertools.combinations(y, 2)) / math.comb(
        k, 2
    )
    return m * k / (m + k) * (2 * between - within_x - within_y)


def test_hand_worked_q_values():
    # [0,0,0,3,3]: tau=2: X=[0,0], Y=[0,3,3]: mean|x-y| = 12/6 = 2, within X 0, within Y
    # (3+3+0)/3 = 2 -> E = 4 - 0 - 2 = 2, Q = 2*3/5*2 = 2.4; tau=3: E = 2*3 = 6, Q = 6/5*6 = 7.2
    q = energy_q([0, 0, 0, 3, 3])
    assert q[2] == pytest.approx(2.4)
    assert q[3] == pytest.approx(7.2)
    assert np.isnan(q[[0, 1, 4, 5]]).all()  # a side with fewer than two points
    # [0,0,1,1] split in the middle: E = 2*1 - 0 - 0 = 2, Q = 2*2/4*2 = 2
    assert energy_q([0, 0, 1, 1])[2] == pytest.approx(2.0)
    # [0,1,0,1]: mean|x-y| = 2/4, within each side 1 -> E = 1 - 2 = -1, Q = -1
    assert energy_q([0, 1, 0, 1])[2] == pytest.approx(-1.0)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("exponent", [1.0, 0.5, 1.5])
def test_q_equals_the_brute_force_definition(seed, exponent):
    z = np.random.default_rng(seed).normal(size=11) * 3
    fast = energy_q(z, exponent=exponent, min_size=2)
    for tau in range(2, 10):
        assert fast[tau] == pytest.approx(brute_q(z, tau, exponent), rel=1e-9, abs=1e-9)


def test_batched_q_equals_one_series_at_a_time():
    z = np.random.default_rng(7).normal(size=(4, 9))
    batched = energy_q(z)
    for row, series in zip(batched, z, strict=True):
        np.testing.assert_allclose(row, energy_q(series), equal_nan=True)


def test_permutation_p_value_of_the_hand_case():
    # [0,0,1,1]: of the 6 distinct orders only 0011 and 1100 reach Q = 2 (the others give
    # Q = -1 or 0), so the exact permutation p-value is 2/6; the sampled one is close to it.
    found = e_divisive([0, 0, 1, 1], rng=np.random.default_rng(0), permutations=3999,
                       significance=0.999)  # fmt: skip
    assert [c.index for c in found] == [2]
    assert found[0].p_value == pytest.approx(1 / 3, abs=0.03)


def test_a_step_is_found_where_it_is():
    rng = np.random.default_rng(1)
    z = np.r_[rng.normal(100, 3, 19), rng.normal(130, 3, 11)]
    found = e_divisive(z, rng=np.random.default_rng(0))
    assert [c.index for c in found] == [19]
    assert found[0].p_value <= 0.01


def test_two_steps_are_found_hierarchically():
    rng = np.random.default_rng(2)
    z = np.r_[rng.normal(10, 1, 12), rng.normal(20, 1, 12), rng.normal(5, 1, 12)]
    assert [c.index for c in e_divisive(z, rng=np.random.default_rng(0))] == [12, 24]


def test_no_step_no_change_point():  # negative control of the step test
    z = np.random.default_rng(3).normal(100, 3, 30)
    assert e_divisive(z, rng=np.random.default_rng(0), significance=0.01) == []


def test_one_outlier_is_not_a_change_point():
    z = np.full(20, 50.0) + np.random.default_rng(4).normal(0, 1, 20)
    z[-1] = 500.0  # one wild run at the end: each side needs two points
    assert e_divisive(z, rng=np.random.default_rng(0)) == []


def test_short_series_and_bad_input():
    assert e_divisive([1.0, 2.0, 3.0], rng=np.random.default_rng(0)) == []
    with pytest.raises(ValueError):
        e_divisive([1.0, math.nan, 2.0, 3.0], rng=np.random.default_rng(0))
    with pytest.raises(ValueError):
        energy_q([1.0, 2.0], min_size=1)


def test_detection_broken_fails_the_step_test(monkeypatch):
    # Negative control: with Q computed as zero everywhere the step at 19 is not found.
    monkeypatch.setattr(
        changepoint,
        "energy_q",
        lambda values, **kw: np.zeros(np.shape(values)[:-1] + (np.shape(values)[-1] + 1,)),
    )
    rng = np.random.default_rng(1)
    z = np.r_[rng.normal(100, 3, 19), rng.normal(130, 3, 11)]
    assert [c.index for c in e_divisive(z, rng=np.random.default_rng(0))] != [19]
