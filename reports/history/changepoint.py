"""E-divisive means: where a series of run figures changes level, found without assuming a
distribution (Matteson and James, "A Nonparametric Approach for Multiple Change Point
Analysis of Multivariate Data", JASA 2014; the method behind MongoDB's and Otava's/Hunter's
performance-regression detection).

For a split of a series at `tau` into X = z[:tau] and Y = z[tau:] (sizes m and k), the
energy statistic is

    E = 2 mean|x - y|^a  -  mean_{i<j}|x_i - x_j|^a  -  mean_{i<j}|y_i - y_j|^a
    Q = m k / (m + k) * E

with 0 < a < 2 (here a = 1). Q is large when the two sides differ more than each side varies
within itself. The best split maximises Q over every `tau` that leaves `min_size` points on
each side; its significance is a permutation test: the points of each current segment are
shuffled within that segment `permutations` times and the best Q recomputed; the p-value is
(1 + number of shuffles with Q >= the observed Q) / (1 + permutations). A significant split
is kept and the search repeats over the segments (hierarchically) until the best remaining
split is not significant.

So a single outlying run is never a change point on its own (each side needs `min_size`
points and an outlier alone does not beat the shuffles), and a run-to-run shift is located at
the first run of its new level. Q for every `tau` of every shuffle comes from one 2-D prefix
sum of the distance matrix: O(permutations x n^2) per step, milliseconds for a few hundred
runs. Randomness comes from the generator passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_MIN_SIZE = 2
DEFAULT_PERMUTATIONS = 199
DEFAULT_SIGNIFICANCE = 0.05
_BATCH_CELLS = 2_000_000  # distance-matrix cells computed at once


@dataclass(frozen=True)
class ChangePoint:
    """A level change: `index` is the position of the first point of the new level."""

    index: int
    q: float
    p_value: float


def energy_q(values: np.ndarray, *, exponent: float = 1.0, min_size: int = DEFAULT_MIN_SIZE):
    """Q for every split of `values` (1-D, or 2-D `[batch, n]` for many series at once): an
    array `[..., n + 1]` whose entry `tau` is Q of the split z[:tau] | z[tau:], NaN where a
    side would have fewer than `min_size` points (min_size >= 2: a side's spread needs a
    pair)."""
    if min_size < 2:
        raise ValueError("min_size must be at least 2.")
    z = np.atleast_2d(np.asarray(values, dtype=np.float64))  # [batch, n]
    batch, n = z.shape
    out = np.full((batch, n + 1), np.nan)
    taus = np.arange(min_size, n - min_size + 1)
    if taus.size == 0:
        return out if np.ndim(values) == 2 else out[0]
    d = np.abs(z[:, :, None] - z[:, None, :]) ** exponent  # [batch, n, n]
    s = np.zeros((batch, n + 1, n + 1))
    s[:, 1:, 1:] = d.cumsum(axis=1).cumsum(axis=2)  # s[:, a, b] = d[:, :a, :b].sum()
    m = taus.astype(np.float64)
    k = n - m
    within_x = s[:, taus, taus]  # ordered pairs: twice the sum over i < j
    cross = s[:, taus, n] - within_x
    within_y = s[:, n, n][:, None] - 2 * s[:, taus, n] + within_x
    energy = 2 * cross / (m * k) - within_x / (m * (m - 1)) - within_y / (k * (k - 1))
    out[:, taus] = m * k / n * energy
    return out if np.ndim(values) == 2 else out[0]


def _best_split(z: np.ndarray, segments, exponent: float, min_size: int):
    """(tau, Q) of the best split over all segments, or None when none can split."""
    best = None
    for start, end in segments:
        q = energy_q(z[start:end], exponent=exponent, min_size=min_size)
        if np.all(np.isnan(q)):
            continue
        tau = int(np.nanargmax(q))
        if best is None or q[tau] > best[1]:
            best = (start + tau, float(q[tau]))
    return best


def _shuffled_best(z, segments, exponent, min_size, permutations, rng) -> np.ndarray:
    """The best Q over all segments for each of `permutations` within-segment shuffles."""
    best = np.full(permutations, -np.inf)
    for start, end in segments:
        if end - start < 2 * min_size:
            continue
        segment = z[start:end]
        keys = rng.random((permutations, segment.size))
        shuffled = segment[np.argsort(keys, axis=1)]  # [permutations, size]
        step = max(1, _BATCH_CELLS // segment.size**2)  # bounds the [batch, n, n] distances
        for first in range(0, permutations, step):
            q = energy_q(shuffled[first : first + step], exponent=exponent, min_size=min_size)
            best[first : first + step] = np.maximum(
                best[first : first + step], np.nanmax(q, axis=1)
            )
    return best


def e_divisive(
    values,
    *,
    rng: np.random.Generator,
    min_size: int = DEFAULT_MIN_SIZE,
    permutations: int = DEFAULT_PERMUTATIONS,
    significance: float = DEFAULT_SIGNIFICANCE,
    exponent: float = 1.0,
) -> list[ChangePoint]:
    """The significant change points of `values` (1-D, NaN-free), sorted by index, found as
    this module's docstring describes. An empty list when nothing changes or the series is
    shorter than 2 x `min_size`."""
    z = np.asarray(values, dtype=np.float64)
    if z.ndim != 1 or not np.all(np.isfinite(z)):
        raise ValueError("e_divisive needs a one-dimensional series of finite values.")
    found: list[ChangePoint] = []
    bounds = [0, z.size]
    while True:
        segments = list(zip(bounds[:-1], bounds[1:], strict=True))
        best = _best_split(z, segments, exponent, min_size)
        if best is None:
            break
        tau, q = best
        shuffled = _shuffled_best(z, segments, exponent, min_size, permutations, rng)
        p_value = (1 + int(np.count_nonzero(shuffled >= q - 1e-12 * abs(q)))) / (1 + permutations)
        if p_value > significance:
            break
        found.append(ChangePoint(index=tau, q=q, p_value=p_value))
        bounds = sorted([*bounds, tau])
    return sorted(found, key=lambda c: c.index)
