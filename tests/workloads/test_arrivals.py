"""Arrival processes: empirical rates and coefficients of variation on large samples."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workloads.arrivals import (
    AllAtOnce,
    ClosedLoop,
    GammaProcess,
    LinearRamp,
    Stage,
    Stages,
    TraceTimes,
    arrivals_from_spec,
)
from workloads.schema import WorkloadError

N = 100_000


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def cv(x: np.ndarray) -> float:
    return float(np.std(x) / np.mean(x))


@pytest.mark.parametrize("burstiness, expected_cv", [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_gamma_rate_and_cv(burstiness, expected_cv):
    times = GammaProcess(rate=8.0, burstiness=burstiness, normalize_total=False).times(
        N, None, rng()
    )
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert N / times[-1] == pytest.approx(8.0, rel=0.03)
    assert cv(gaps) == pytest.approx(expected_cv, rel=0.03)


def test_vllm_normalisation_keeps_cv_and_fixes_total():
    times = GammaProcess(rate=5.0, burstiness=0.5).times(N, None, rng())
    assert times[-1] == pytest.approx(N / 5.0)
    assert cv(np.diff(times)) == pytest.approx(math.sqrt(2), rel=0.03)


def test_constant_and_all_at_once():
    times = arrivals_from_spec({"process": "constant", "rate": 4}).times(5, None, rng())
    assert times.tolist() == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.25])
    assert AllAtOnce().times(3, None, rng()).tolist() == [0.0, 0.0, 0.0]


def test_duration_bounds_poisson_count():
    times = GammaProcess(rate=10.0).times(None, 1000.0, rng())
    # Poisson count over 1000 s at 10/s: mean 10,000, sd 100
    assert abs(len(times) - 10_000) < 400
    assert times.max() <= 1000.0 and np.all(np.diff(times) >= 0)
    capped = GammaProcess(rate=10.0).times(50, 1000.0, rng())
    assert len(capped) == 50


def test_linear_ramp_counts():
    ramp = LinearRamp(start_rate=10.0, end_rate=90.0, ramp_s=100.0)
    times = ramp.times(None, 100.0, rng())
    # expected counts: integral of 10 + 0.8 t over [0, 50] = 1500, over [50, 100] = 3500
    first = int((times <= 50).sum())
    assert abs(first - 1500) < 4 * math.sqrt(1500)
    assert abs(len(times) - first - 3500) < 4 * math.sqrt(3500)
    after = LinearRamp(start_rate=1.0, end_rate=2.0, ramp_s=10.0, constant=True).times(
        None, 20.0, rng()
    )
    # constant spacing in intensity: 15 over the ramp, 20 after it
    assert len(after) == 35
    assert np.all(np.diff(after[20:]) == pytest.approx(0.5))


def test_stages():
    proc = Stages(stages=(Stage(10.0, 5.0, math.inf), Stage(10.0, 20.0, math.inf)))
    times = proc.times(None, None, rng())
    assert int((times <= 10).sum()) == 50 and len(times) == 250
    poisson = arrivals_from_spec(
        {
            "process": "stages",
            "stages": [{"duration_s": 500, "rate": 2}, {"duration_s": 500, "rate": 8}],
        }
    ).times(None, None, rng())
    first = int((poisson <= 500).sum())
    assert abs(first - 1000) < 130 and abs(len(poisson) - first - 4000) < 260


def test_trace_times_speedup_and_jitter():
    proc = TraceTimes(timestamps_s=(100.0, 101.0, 103.0), speedup=2.0)
    assert proc.times(None, None, rng()).tolist() == [0.0, 0.5, 1.5]
    base = np.arange(0.0, 20_000.0, 1.0)
    jittered = TraceTimes(timestamps_s=tuple(base), jitter_s=0.1).times(None, None, rng())
    assert np.std(jittered[1:] - base[1:]) == pytest.approx(0.1, rel=0.05)


def test_closed_loop_has_no_times():
    assert ClosedLoop(concurrency=4).times(10, None, rng()) is None


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"process": "poisson"}, "needs the field 'rate'"),
        ({"process": "poisson", "rate": 0}, "positive"),
        ({"process": "warp", "rate": 1}, "unknown process"),
        ({"process": "gamma", "rate": 1, "burstiness": 1, "x": 2}, "unknown field"),
        ({"process": "stages", "stages": []}, "at least one stage"),
        ({"rate": 1}, "process"),
    ],
)
def test_spec_errors(spec, match):
    with pytest.raises(WorkloadError, match=match):
        arrivals_from_spec(spec)


@settings(max_examples=80, deadline=None)
@given(
    rate=st.floats(0.01, 1000.0),
    burstiness=st.floats(0.05, 50.0),
    n=st.integers(1, 500),
    seed=st.integers(0, 2**32 - 1),
    normalize=st.booleans(),
)
def test_property_gamma_schedules(rate, burstiness, n, seed, normalize):
    times = GammaProcess(rate=rate, burstiness=burstiness, normalize_total=normalize).times(
        n, None, rng(seed)
    )
    assert len(times) == n and np.all(times >= 0) and np.all(np.diff(times) >= 0)
    if normalize:
        assert times[-1] == pytest.approx(n / rate)
    again = GammaProcess(rate=rate, burstiness=burstiness, normalize_total=normalize).times(
        n, None, rng(seed)
    )
    assert np.array_equal(times, again)
