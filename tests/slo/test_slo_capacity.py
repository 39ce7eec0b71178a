"""Capacity search on simulated probes: deterministic, noisy and glitchy systems."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slo.capacity import CapacitySearchError, ProbeResult, search

MU_PER_S = 20.0  # service rate of the simulated M/M/1 server
LIMIT_S = 1.0  # per-request latency objective
TARGET = 0.99
# P(latency <= T) = 1 - exp(-(mu - rate) T) for rate < mu; it equals TARGET at:
KNEE = MU_PER_S - math.log(1 / (1 - TARGET)) / LIMIT_S  # 15.395 requests/s


def mm1_attainment(rate: float) -> float:
    if rate >= MU_PER_S:
        return 0.0
    return 1 - math.exp(-(MU_PER_S - rate) * LIMIT_S)


def deterministic(rate: float) -> ProbeResult:
    a = mm1_attainment(rate)
    return ProbeResult(rate, a, goodput_per_s=rate * a)


def test_finds_the_knee_of_a_saturating_system():
    result = search(deterministic, target=TARGET, start_rate=1.0, max_iterations=30)
    assert result.converged and result.confirmed
    assert result.stop_reason == "converged"
    assert abs(result.capacity_rate_per_s - KNEE) / KNEE <= 0.05
    low, high = result.bracket
    assert low <= KNEE <= high and (high - low) / low <= 0.025
    assert result.iterations == len(result.curve) <= 30
    points = result.curve_points()
    assert [p["rate_per_s"] for p in points] == sorted(p["rate_per_s"] for p in points)
    assert all(p["meets_target"] == (p["rate_per_s"] <= KNEE) for p in points)
    # the ramp started at 1 and doubled: 1, 2, 4, 8, 16 (16 fails)
    assert [p.rate_per_s for p in result.curve[:5]] == [1, 2, 4, 8, 16]
    assert result.to_dict()["curve_points"] == points


def test_ramps_down_when_the_start_rate_fails():
    result = search(deterministic, target=TARGET, start_rate=100.0, max_iterations=30)
    assert [p.rate_per_s for p in result.curve[:4]] == [100, 50, 25, 12.5]
    assert abs(result.capacity_rate_per_s - KNEE) / KNEE <= 0.05 and result.confirmed


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_finds_the_knee_of_a_noisy_system(seed):
    rng = np.random.default_rng(seed)
    requests_per_probe = 2000

    def noisy(rate: float) -> ProbeResult:
        good = rng.binomial(requests_per_probe, mm1_attainment(rate))
        return ProbeResult(rate, good / requests_per_probe)

    result = search(noisy, target=TARGET, start_rate=1.0, max_iterations=30)
    assert result.capacity_rate_per_s is not None
    assert abs(result.capacity_rate_per_s - KNEE) / KNEE <= 0.05


def test_rechecks_recover_from_a_transient_failure():
    calls = []

    def glitchy(rate: float) -> ProbeResult:
        calls.append(rate)
        if len(calls) == 6:  # the first bisection probe (at 12 req/s) glitches once
            return ProbeResult(rate, 0.5)
        return deterministic(rate)

    result = search(glitchy, target=TARGET, start_rate=1.0, max_iterations=40)
    assert calls[5] == 12.0
    assert abs(result.capacity_rate_per_s - KNEE) / KNEE <= 0.05
    assert result.confirmed


def test_limits_and_budget():
    always = search(lambda r: ProbeResult(r, 1.0), target=TARGET, start_rate=1, max_rate=8)
    assert always.capacity_rate_per_s == 8 and always.stop_reason == "target still met at max_rate"
    never = search(lambda r: ProbeResult(r, 0.0), target=TARGET, start_rate=1, min_rate=0.25)
    assert never.capacity_rate_per_s is None and not never.confirmed
    assert never.stop_reason == "target not met even at the lowest rate tried"
    short = search(deterministic, target=TARGET, start_rate=1.0, max_iterations=6)
    assert short.iterations == 6 and not short.converged
    assert short.stop_reason == "max_iterations reached"
    # out of budget mid-ramp (1, 2, 4 pass; 8 would need the confirming run's call):
    # the best rate so far is kept and confirmed
    ramp = search(deterministic, target=TARGET, start_rate=1.0, max_iterations=4)
    assert [p.rate_per_s for p in ramp.curve] == [1, 2, 4, 4]
    assert ramp.capacity_rate_per_s == 4 and ramp.bracket == (4, None) and ramp.confirmed


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(target=0),
        dict(start_rate=0),
        dict(max_iterations=1),
        dict(rel_width=0),
        dict(growth=1),
        dict(max_rate=0.5),
        dict(min_rate=2.0),
        dict(min_rate=3, max_rate=2),
    ],  # fmt: skip
)
def test_bad_parameters(kwargs):
    args = dict(target=TARGET, start_rate=1.0) | kwargs
    with pytest.raises(CapacitySearchError):
        search(deterministic, **args)


def test_probe_must_return_a_probe_result():
    with pytest.raises(CapacitySearchError, match="ProbeResult"):
        search(lambda r: 0.99, target=TARGET, start_rate=1.0)
    with pytest.raises(CapacitySearchError, match="attainment"):
        ProbeResult(1.0, 1.5)
