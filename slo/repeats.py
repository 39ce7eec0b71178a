"""Statistics over repeated runs of one target: the mean of a figure across repetitions and its
Student-t confidence interval, and the ratio of one target's mean to another's."""

from __future__ import annotations

import math

import numpy as np

# Two-sided 95% Student-t quantiles t(0.975, df) for df = 1..30; above 30 the normal's 1.96
# is within 2% of t.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_quantile_975(df: int) -> float:
    """t(0.975, df) for df >= 1 (1.96 beyond the table)."""
    if df < 1:
        raise ValueError("df must be at least 1")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci(values) -> dict:
    """`{n, mean, ci_low, ci_high}` of the defined values: the mean and its 95% t-interval
    (mean ± t · s / sqrt(n), s the sample standard deviation). With one value the interval is
    None (nothing to estimate spread from); with none, everything but n is None."""
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    x = x[np.isfinite(x)]
    n = int(x.size)
    if n == 0:
        return {"n": 0, "mean": None, "ci_low": None, "ci_high": None}
    mean = float(x.mean())
    if n == 1:
        return {"n": 1, "mean": mean, "ci_low": None, "ci_high": None}
    half = t_quantile_975(n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
    return {"n": n, "mean": mean, "ci_low": mean - half, "ci_high": mean + half}


def ratio(value: float | None, baseline: float | None) -> float | None:
    """value / baseline, None when either is missing or the baseline is 0."""
    if value is None or baseline is None or baseline == 0:
        return None
    return value / baseline
