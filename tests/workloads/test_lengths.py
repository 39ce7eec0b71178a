"""Length distributions: bounds, moments and quantiles on large samples, determinism, spec errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from workloads.lengths import Empirical, Fixed, length_from_spec, uniform_bounds
from workloads.schema import WorkloadError

N = 200_000


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_fixed():
    assert Fixed(value=37).sample(5, rng()).tolist() == [37] * 5
    assert length_from_spec(12).sample(3, rng()).tolist() == [12] * 3


@pytest.mark.parametrize(
    "value, ratio, bounds",
    [
        (100, 0.25, (75, 125)),
        (10, 0.55, (4, 16)),
        (1, 0.5, (1, 2)),
        (1024, 0.0, (1024, 1024)),
        (3, 0.9, (1, 6)),
    ],
)
def test_uniform_bounds_follow_vllm(value, ratio, bounds):
    # vLLM: low = floor(L * (1 - r)), high = ceil(L * (1 + r)), inclusive, low raised to 1
    assert uniform_bounds(value, ratio) == bounds


def test_uniform_rejects_ratio_of_one():
    with pytest.raises(WorkloadError, match="range_ratio"):
        uniform_bounds(10, 1.0)


def test_uniform_samples_every_integer_equally():
    dist = length_from_spec({"dist": "uniform", "value": 10, "range_ratio": 0.5})
    x = dist.sample(N, rng())
    assert x.min() == 5 and x.max() == 15
    counts = np.bincount(x - 5, minlength=11)
    assert stats.chisquare(counts).pvalue > 1e-4


def test_normal_moments_and_clipping():
    x = length_from_spec({"dist": "normal", "mean": 500, "std": 50}).sample(N, rng())
    assert x.mean() == pytest.approx(500, abs=1.0)
    assert x.std() == pytest.approx(50, rel=0.02)
    clipped = length_from_spec({"dist": "normal", "mean": 10, "std": 20, "max": 40}).sample(
        N, rng(1)
    )
    assert clipped.min() == 1 and clipped.max() == 40
    # rounding then clipping: P(value == 1) = P(X < 1.5)
    assert (clipped == 1).mean() == pytest.approx(stats.norm.cdf(1.5, 10, 20), abs=0.005)
    assert (clipped == 40).mean() == pytest.approx(stats.norm.sf(39.5, 10, 20), abs=0.005)


def test_lognormal_median_and_sigma():
    x = length_from_spec({"dist": "lognormal", "median": 200, "sigma": 0.8}).sample(N, rng())
    assert np.median(x) == pytest.approx(200, rel=0.02)
    assert np.log(x).std() == pytest.approx(0.8, rel=0.02)
    same = length_from_spec({"dist": "lognormal", "mu": math.log(200), "sigma": 0.8}).sample(
        N, rng()
    )
    assert np.array_equal(x, same)


def test_empirical_quantiles_are_reproduced():
    points = [[0.0, 10], [0.5, 100], [0.9, 400], [1.0, 1000]]
    x = length_from_spec({"dist": "empirical", "quantiles": points}).sample(N, rng())
    assert x.min() >= 10 and x.max() <= 1000
    for p, v in points[1:-1]:
        assert np.quantile(x, p) == pytest.approx(v, rel=0.02)
    # between quantile points the CDF is linear: P(X <= 250) = 0.5 + 0.4 * 150/300
    assert (x <= 250).mean() == pytest.approx(0.7, abs=0.005)


def test_histogram():
    dist = length_from_spec(
        {"dist": "empirical", "histogram": {"edges": [1, 11, 21, 101], "counts": [1, 3, 6]}}
    )
    x = dist.sample(N, rng())
    assert (x <= 10).mean() == pytest.approx(0.1 * 9.5 / 10, abs=0.01)
    assert ((x > 21) & (x <= 101)).mean() == pytest.approx(0.6 * 79.5 / 80, abs=0.01)
    assert isinstance(dist, Empirical)


def test_file_lengths(tmp_path):
    plain = tmp_path / "lens.txt"
    plain.write_text("5\n7\n\n9\n")
    x = length_from_spec({"dist": "file", "path": str(plain)}).sample(3000, rng())
    assert set(x.tolist()) == {5, 7, 9}
    table = tmp_path / "lens.csv"
    table.write_text("a,tokens\nx,11\ny,13\n")
    x = length_from_spec(
        {"dist": "file", "path": "lens.csv", "column": "tokens"}, base_dir=tmp_path
    ).sample(100, rng())
    assert set(x.tolist()) == {11, 13}
    table.write_text("a,tokens\nx,11\ny,many\n")
    with pytest.raises(WorkloadError, match=r"lens.csv:3"):
        length_from_spec({"dist": "file", "path": str(table), "column": "tokens"})


def test_seeded_determinism():
    spec = {"dist": "lognormal", "median": 50, "sigma": 1.0, "max": 500}
    a = length_from_spec(spec).sample(1000, rng(3))
    b = length_from_spec(spec).sample(1000, rng(3))
    c = length_from_spec(spec).sample(1000, rng(4))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"dist": "zipf"}, "unknown dist"),
        ({"dist": "normal", "mean": 3}, "needs the field 'std'"),
        ({"dist": "fixed", "value": 3, "colour": 1}, "unknown field"),
        ({"dist": "empirical", "quantiles": [[0.1, 1], [1.0, 5]]}, "rise from 0 to 1"),
        ({"dist": "fixed", "value": 0}, "at least 1"),
        ("many", "integer or a mapping"),
        ({"dist": "empirical", "bundled": "azure-2023-foo/input"}, "known"),
    ],
)
def test_spec_errors(spec, match):
    with pytest.raises(WorkloadError, match=match):
        length_from_spec(spec)
