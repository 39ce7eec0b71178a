"""Two-run statistics for the regression gate: a ratio with a seeded bootstrap interval, and
the Mann-Whitney U test.

A side (baseline or candidate) is a list of `Sample`s, one per run repetition. Each sample
holds the per-request values of one metric (TTFT in ms, output tokens, a 0/1 "good" flag, ...)
and the run's measurement window in seconds. A `Statistic` turns pooled values into one figure:
a quantile (latency percentiles), a mean, or a rate (sum of values per second of window, for
throughputs and goodput).

The bootstrap resamples whole runs when a side has several repetitions (run-to-run variation is
then the honest unit of noise) and requests within the run when it has one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

STATISTIC_KINDS = ("quantile", "mean", "rate")


@dataclass(frozen=True)
class Sample:
    """Per-request values of one metric from one run, and that run's window in seconds.

    `values` must be finite; drop requests the metric does not apply to before building it.
    `groups`, when given, labels each value with the request it came from (integers, one per
    value): pooled inter-token gaps are several values per request, and the bootstrap then
    resamples requests, keeping each request's gaps together, and counts requests as units.
    """

    values: np.ndarray
    window_s: float
    groups: np.ndarray | None = None

    def __post_init__(self) -> None:
        values = np.asarray(self.values, dtype=np.float64)
        if values.ndim != 1:
            raise ValueError("Sample.values must be one-dimensional.")
        if not np.all(np.isfinite(values)):
            raise ValueError("Sample.values must be finite; drop requests without a value.")
        if not (self.window_s > 0 and math.isfinite(self.window_s)):
            raise ValueError(f"Sample.window_s must be positive and finite, got {self.window_s}.")
        object.__setattr__(self, "values", values)
        if self.groups is not None:
            groups = np.asarray(self.groups)
            if groups.shape != values.shape:
                raise ValueError("Sample.groups must label every value.")
            # Sort by group so each group is a contiguous run of values.
            order = np.argsort(groups, kind="stable")
            object.__setattr__(self, "values", values[order])
            object.__setattr__(self, "groups", groups[order])

    @property
    def n_units(self) -> int:
        """Independent units: groups (requests) when labelled, else values."""
        if self.groups is None:
            return int(self.values.size)
        return int(np.unique(self.groups).size)


@dataclass(frozen=True)
class Statistic:
    """How pooled values become one figure: `quantile` (with `q` in [0, 1]), `mean`, or
    `rate` (sum of values divided by the summed window, per second)."""

    kind: str
    q: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in STATISTIC_KINDS:
            raise ValueError(f"Statistic.kind must be one of {STATISTIC_KINDS}, got {self.kind!r}.")
        if self.kind == "quantile" and (self.q is None or not 0.0 <= self.q <= 1.0):
            raise ValueError("A quantile statistic needs q in [0, 1].")

    def min_samples(self, floor: int) -> int:
        """Fewest pooled values for a meaningful estimate: `floor`, and for a tail quantile
        enough values that at least one lies beyond it (100 for p99)."""
        if self.kind == "quantile" and self.q is not None and self.q < 1.0:
            return max(floor, math.ceil(1.0 / (1.0 - self.q) - 1e-9))
        return floor

    def compute(self, values: np.ndarray, window_s: float) -> float:
        """The statistic of `values` (NaN when there are none and it is not a rate)."""
        return float(self._batched(np.asarray(values, dtype=np.float64)[None, :], window_s)[0])

    def _batched(self, values_2d: np.ndarray, window_s: float | np.ndarray) -> np.ndarray:
        # values_2d: [resamples, n]
        if self.kind == "rate":
            return values_2d.sum(axis=1) / window_s
        if values_2d.shape[1] == 0:
            return np.full(values_2d.shape[0], np.nan)
        if self.kind == "mean":
            return values_2d.mean(axis=1)
        return np.quantile(values_2d, self.q, axis=1)


@dataclass(frozen=True)
class RatioEstimate:
    """candidate / baseline for one statistic, with a bootstrap percentile interval.

    `ratio`, `ci_low`, `ci_high` are NaN when the baseline figure is zero or undefined.
    `n_*` count pooled values, `units_*` the independent units behind them (requests, or
    values when unlabelled). `resampled_*` says what the bootstrap drew: "requests" or "runs".
    """

    baseline: float
    candidate: float
    ratio: float
    ci_low: float
    ci_high: float
    confidence: float
    n_resamples: int
    n_baseline: int
    n_candidate: int
    units_baseline: int
    units_candidate: int
    runs_baseline: int
    runs_candidate: int
    resampled_baseline: str
    resampled_candidate: str


def _pooled(side: Sequence[Sample]) -> tuple[np.ndarray, float]:
    values = np.concatenate([s.values for s in side]) if side else np.empty(0)
    return values, float(sum(s.window_s for s in side))


def _bootstrap_side(
    side: Sequence[Sample], statistic: Statistic, rng: np.random.Generator, n_resamples: int
) -> tuple[np.ndarray, str]:
    """`n_resamples` bootstrap replicates of the statistic for one side."""
    if len(side) >= 2:
        picks = rng.integers(0, len(side), size=(n_resamples, len(side)))
        out = np.empty(n_resamples)
        for b in range(n_resamples):
            chosen = [side[i] for i in picks[b]]
            values, window_s = _pooled(chosen)
            out[b] = statistic.compute(values, window_s)
        return out, "runs"
    (sample,) = side
    n = sample.values.size
    if n == 0:
        return np.full(n_resamples, statistic.compute(sample.values, sample.window_s)), "requests"
    if sample.groups is not None:
        return _bootstrap_groups(sample, statistic, rng, n_resamples), "requests"
    draws = sample.values[rng.integers(0, n, size=(n_resamples, n))]
    return statistic._batched(draws, sample.window_s), "requests"


def weighted_statistic(
    statistic: Statistic, sorted_values: np.ndarray, weights_2d: np.ndarray, window_s: float
) -> np.ndarray:
    """The statistic of each row of `weights_2d` applied to `sorted_values` (ascending): row
    b stands for the array in which value i appears weights_2d[b, i] times (non-negative
    integers). Equals `statistic` over that repeated array, without building it."""
    weights = np.asarray(weights_2d, dtype=np.int64)  # [resamples, n]
    if statistic.kind in ("rate", "mean"):
        totals = weights @ sorted_values
        if statistic.kind == "rate":
            return totals / window_s
        counts = weights.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return totals / counts
    cumulative = np.cumsum(weights, axis=1)
    counts = cumulative[:, -1] if weights.shape[1] else np.zeros(weights.shape[0], np.int64)
    out = np.full(weights.shape[0], np.nan)
    last = sorted_values.size - 1
    for b in np.flatnonzero(counts > 0):
        position = (counts[b] - 1) * statistic.q
        low = math.floor(position)
        frac = position - low
        i_low, i_high = np.searchsorted(cumulative[b], [low, low + 1], side="right")
        i_low, i_high = min(int(i_low), last), min(int(i_high), last)
        out[b] = sorted_values[i_low] + frac * (sorted_values[i_high] - sorted_values[i_low])
    return out


def _bootstrap_groups(
    sample: Sample,
    statistic: Statistic,
    rng: np.random.Generator,
    n_resamples: int,
    batch: int = 64,
) -> np.ndarray:
    """Resample whole groups: a replicate holds every value of a drawn group, as many times
    as the group was drawn."""
    _, group_index = np.unique(sample.groups, return_inverse=True)
    n_groups = int(group_index.max()) + 1
    order = np.argsort(sample.values, kind="stable")
    sorted_values = sample.values[order]
    sorted_groups = group_index[order]
    out = np.empty(n_resamples)
    for start in range(0, n_resamples, batch):
        size = min(batch, n_resamples - start)
        draws = rng.integers(0, n_groups, size=(size, n_groups))
        # times_drawn[b, g]: how often replicate b drew group g
        offsets = (np.arange(size) * n_groups)[:, None]
        times_drawn = np.bincount((draws + offsets).ravel(), minlength=size * n_groups)
        weights = times_drawn.reshape(size, n_groups)[:, sorted_groups]  # [size, n_values]
        out[start : start + size] = weighted_statistic(
            statistic, sorted_values, weights, sample.window_s
        )
    return out


def bootstrap_ratio(
    baseline: Sequence[Sample],
    candidate: Sequence[Sample],
    statistic: Statistic,
    *,
    rng: np.random.Generator,
    n_resamples: int = 2000,
    confidence: float = 0.95,
) -> RatioEstimate:
    """Estimate candidate/baseline of `statistic` with a percentile bootstrap interval.

    Each side is resampled independently: whole runs when it has two or more samples, requests
    otherwise. The same `rng` state gives the same interval. Raises ValueError on an empty side.
    """
    if not baseline or not candidate:
        raise ValueError("bootstrap_ratio needs at least one sample per side.")
    if not 0.0 < confidence < 1.0:
        raise ValueError("confidence must be in (0, 1).")
    base_values, base_window = _pooled(baseline)
    cand_values, cand_window = _pooled(candidate)
    base_point = statistic.compute(base_values, base_window)
    cand_point = statistic.compute(cand_values, cand_window)
    base_boot, base_how = _bootstrap_side(baseline, statistic, rng, n_resamples)
    cand_boot, cand_how = _bootstrap_side(candidate, statistic, rng, n_resamples)
    ratio = ci_low = ci_high = math.nan
    if math.isfinite(base_point) and base_point != 0.0 and math.isfinite(cand_point):
        ratio = cand_point / base_point
        with np.errstate(divide="ignore", invalid="ignore"):
            boot_ratio = cand_boot / base_boot
        boot_ratio = boot_ratio[np.isfinite(boot_ratio)]
        if boot_ratio.size:
            alpha = (1.0 - confidence) / 2.0
            ci_low, ci_high = (float(x) for x in np.quantile(boot_ratio, [alpha, 1.0 - alpha]))
    return RatioEstimate(
        baseline=base_point,
        candidate=cand_point,
        ratio=ratio,
        ci_low=ci_low,
        ci_high=ci_high,
        confidence=confidence,
        n_resamples=n_resamples,
        n_baseline=int(base_values.size),
        n_candidate=int(cand_values.size),
        units_baseline=sum(s.n_units for s in baseline),
        units_candidate=sum(s.n_units for s in candidate),
        runs_baseline=len(baseline),
        runs_candidate=len(candidate),
        resampled_baseline=base_how,
        resampled_candidate=cand_how,
    )


@dataclass(frozen=True)
class MannWhitney:
    """Two-sided Mann-Whitney U test of candidate against baseline.

    `u` is the statistic for the candidate sample; `p_value` the two-sided p-value.
    """

    u: float
    p_value: float
    n_baseline: int
    n_candidate: int


def mann_whitney(
    baseline: np.ndarray, candidate: np.ndarray, *, min_n: int = 8
) -> MannWhitney | None:
    """Mann-Whitney U on two independent samples, or None where the samples do not allow it:
    fewer than `min_n` values on a side, or every value identical (no ranks to compare)."""
    base = np.asarray(baseline, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    if base.size < min_n or cand.size < min_n:
        return None
    if np.unique(np.concatenate([base, cand])).size < 2:
        return None
    from scipy import stats as scipy_stats  # here: importing slo stays light

    result = scipy_stats.mannwhitneyu(cand, base, alternative="two-sided")
    return MannWhitney(
        u=float(result.statistic),
        p_value=float(result.pvalue),
        n_baseline=int(base.size),
        n_candidate=int(cand.size),
    )
