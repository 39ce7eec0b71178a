"""Chart data reduced to a bounded size: CDF points, per-time-bin percentiles, outcome counts.

These only reshape per-request values that `slo` computed (percentiles come from
`slo.metrics.percentile`), so a card stays small however long the run was.
"""

from __future__ import annotations

import math

import numpy as np

from reports.taxonomy import OUTCOME_KINDS
from slo import metrics

NS_PER_S = 1e9
CDF_POINTS = 101
TARGET_BINS = 30
_NICE_STEPS_S = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def cdf_points(values_ms: np.ndarray) -> list[list[float]]:
    """Empirical CDF of the defined values as [[value_ms, fraction <= value], ...].

    Every value when there are at most CDF_POINTS of them; otherwise the 0th..100th
    percentiles in 1% steps. Empty list when no value is defined.
    """
    values = np.sort(np.asarray(values_ms, float)[~np.isnan(np.asarray(values_ms, float))])
    n = values.size
    if n == 0:
        return []
    if n <= CDF_POINTS:
        return [[float(v), (i + 1) / n] for i, v in enumerate(values)]
    qs = np.linspace(0.0, 100.0, CDF_POINTS)
    return [[float(metrics.percentile(values, q)), float(q / 100.0)] for q in qs]


def choose_bin_s(span_s: float | None) -> float | None:
    """A round bin width giving about TARGET_BINS bins over `span_s` seconds (None if no span)."""
    if span_s is None or not math.isfinite(span_s) or span_s <= 0:
        return None
    raw = span_s / TARGET_BINS
    return next((step for step in _NICE_STEPS_S if step >= raw), _NICE_STEPS_S[-1])


def _bin_index(t_ns: np.ndarray, bin_s: float) -> np.ndarray:
    return np.floor(np.asarray(t_ns, float) / NS_PER_S / bin_s)


def percentiles_over_time(
    t_ns: np.ndarray, values_ms: np.ndarray, bin_s: float | None
) -> list[list[float]]:
    """[[bin_start_s, p50_ms, p90_ms], ...] of `values_ms` grouped by `t_ns` into `bin_s` bins.

    Rows whose time or value is undefined are skipped, and so are empty bins.
    """
    if bin_s is None:
        return []
    t = np.asarray(t_ns, float)
    v = np.asarray(values_ms, float)
    keep = ~np.isnan(t) & ~np.isnan(v)
    bins = _bin_index(t[keep], bin_s)
    v = v[keep]
    rows = []
    for b in np.unique(bins):
        in_bin = v[bins == b]
        rows.append(
            [float(b * bin_s), metrics.percentile(in_bin, 50), metrics.percentile(in_bin, 90)]
        )
    return rows


def outcomes_over_time(t_ns: np.ndarray, kinds: np.ndarray, bin_s: float | None) -> list[dict]:
    """[{t_s, ok, rejected, ...}, ...]: outcome counts per `bin_s` bin of `t_ns`, with every
    bin from the first to the last present (zeros included) so gaps show as gaps.

    `t_ns` and `kinds` are aligned row by row (one time per outcome); rows without a time
    are skipped. Raises ValueError when their lengths differ.
    """
    t = np.asarray(t_ns, float)
    kinds = np.asarray(kinds, dtype=object)
    if t.shape != kinds.shape:
        raise ValueError(f"{t.size} times for {kinds.size} outcomes: the rows are not aligned")
    if bin_s is None:
        return []
    keep = ~np.isnan(t)
    if not keep.any():
        return []
    bins = _bin_index(t[keep], bin_s)
    kinds = kinds[keep]
    rows = []
    for b in range(int(bins.min()), int(bins.max()) + 1):
        in_bin = kinds[bins == b]
        row = {"t_s": float(b * bin_s)}
        row.update({kind: int(np.count_nonzero(in_bin == kind)) for kind in OUTCOME_KINDS})
        rows.append(row)
    return rows
