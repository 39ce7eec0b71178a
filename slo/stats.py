"""Statistics for verdicts: seeded bootstrap intervals and binomial (early-stopping) bounds.

The binomial rule follows MLPerf loadgen's early stopping (mlcommons/inference,
loadgen/early_stopping.cc and results.cc, server scenario): with t of n samples over a
latency limit, the claim "the p-th percentile is within the limit" holds at confidence c
when, were exactly a fraction (1 - p) of samples over the limit, seeing t or fewer of n
would have probability at most 1 - c: BinomCDF(t; n, 1 - p) <= 1 - c. loadgen uses
c = 0.99 and tolerance d = 0. This module computes the bound with scipy.stats.binom
rather than loadgen's hypergeometric series.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
_BOOTSTRAP_BATCH_ELEMENTS = 2_000_000
DIRECT_RESAMPLING_LIMIT = 5_000_000


def bootstrap_ci(
    values: np.ndarray,
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    rng: np.random.Generator,
    confidence: float = 0.95,
    n_resamples: int = 1000,
) -> tuple[float, float] | None:
    """Percentile-bootstrap confidence interval of `statistic` over `values` (NaNs dropped).

    `statistic` maps a 2-D array of resamples `[n_resamples_batch, n]` to one value per
    row. Returns (low, high) in the units of the statistic, or None with no defined values.
    Resamples are drawn from the passed-in `rng`, so a seeded generator gives a repeatable
    interval. With one value the interval is that value twice.
    """
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    n = values.size
    if n == 0:
        return None
    batch = max(1, min(n_resamples, _BOOTSTRAP_BATCH_ELEMENTS // n))
    estimates = []
    remaining = n_resamples
    while remaining > 0:
        size = min(batch, remaining)
        resamples = values[rng.integers(0, n, size=(size, n))]  # [size, n]
        estimates.append(np.asarray(statistic(resamples), float))
        remaining -= size
    all_estimates = np.concatenate(estimates)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(all_estimates, [alpha, 1 - alpha])
    return float(low), float(high)


def bootstrap_quantile_ci(
    values: np.ndarray,
    percentile: float,
    *,
    rng: np.random.Generator,
    confidence: float = 0.95,
    n_resamples: int = 1000,
    direct_limit: int = DIRECT_RESAMPLING_LIMIT,
) -> tuple[float, float] | None:
    """Bootstrap interval of the `percentile`-th percentile (0..100, linear interpolation).

    Small samples are resampled directly. When n * n_resamples exceeds `direct_limit`
    (default `DIRECT_RESAMPLING_LIMIT`, 5e6) the same bootstrap distribution is drawn from order
    statistics instead, in O(n log n + n_resamples): the j-th smallest of n resampled
    indices is floor(n * U) with U ~ Beta(j, n + 1 - j), and the next one follows as
    U + (1 - U) * Beta(1, n - j); the linear percentile interpolates between the two.
    """
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    n = values.size
    if n == 0:
        return None
    if n * n_resamples <= direct_limit:
        return bootstrap_ci(
            values,
            lambda r: np.percentile(r, percentile, axis=1, method="linear"),
            rng=rng,
            confidence=confidence,
            n_resamples=n_resamples,
        )
    ordered = np.sort(values)
    return bootstrap_rank_ci(
        n, percentile, ordered.__getitem__, rng=rng, confidence=confidence, n_resamples=n_resamples
    )


def bootstrap_rank_ci(
    n: int,
    percentile: float,
    at_ranks: Callable[[np.ndarray], np.ndarray],
    *,
    rng: np.random.Generator,
    confidence: float = 0.95,
    n_resamples: int = 1000,
) -> tuple[float, float]:
    """`bootstrap_quantile_ci` drawn from order statistics, for n values known only through
    `at_ranks` (0-based ranks -> their values): a sorted array, or a sketch's readback
    (`slo.sketch`), whose interval is then within the sketch's relative error of the exact
    one."""
    h = (n - 1) * percentile / 100
    j = int(np.floor(h))  # 0-based rank of the lower order statistic
    frac = h - j
    u_low = rng.beta(j + 1, n - j, size=n_resamples)
    u_high = u_low + (1 - u_low) * rng.beta(1, max(n - j - 1, 1), size=n_resamples)
    low = at_ranks(np.minimum((n * u_low).astype(np.int64), n - 1))
    high = at_ranks(np.minimum((n * u_high).astype(np.int64), n - 1))
    estimates = low + frac * (high - low)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(estimates, [alpha, 1 - alpha])
    return float(lo), float(hi)


def bootstrap_proportion_ci(
    flags: np.ndarray,
    *,
    rng: np.random.Generator,
    confidence: float = 0.95,
    n_resamples: int = 1000,
) -> tuple[float, float] | None:
    """Bootstrap interval of the fraction of true entries in the boolean array `flags`.

    The mean of n resampled flags is Binomial(n, observed fraction) / n, so the bootstrap
    distribution is drawn from that directly (the same distribution, without the n-wide
    resamples). None for an empty array.
    """
    flags = np.asarray(flags, bool)
    n = flags.size
    if n == 0:
        return None
    estimates = rng.binomial(n, flags.mean(), size=n_resamples) / n
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(estimates, [alpha, 1 - alpha])
    return float(lo), float(hi)


def early_stopping_min_passing(
    overlatency: int, percentile: float, confidence: float = 0.99, tolerance: float = 0.0
) -> int:
    """Fewest samples within the limit needed, besides `overlatency` over it, to pass.

    MLPerf loadgen's `MinPassingQueriesFinder`: the smallest h with
    BinomCDF(t; h + t, 1 - (p - d)) <= 1 - c, where t = `overlatency`, p = `percentile`
    as a fraction in (0, 1), d = `tolerance`, c = `confidence`. For t = 0 this is
    ceil(log(1 - c) / log(p - d)); e.g. 459 for p = c = 0.99.
    """
    if overlatency < 0:
        raise ValueError("overlatency must be >= 0")
    q = percentile - tolerance
    if not 0 < q < 1 or not 0 < confidence < 1:
        raise ValueError("percentile - tolerance and confidence must lie in (0, 1)")
    alpha = 1 - confidence
    from scipy import stats as scipy_stats  # here: importing slo stays light

    def passes(h: int) -> bool:
        return scipy_stats.binom.cdf(overlatency, h + overlatency, 1 - q) <= alpha

    high = max(1, int(np.ceil(np.log(alpha) / np.log(q))))
    while not passes(high):
        high *= 2
    low = 0
    while low < high:
        mid = (low + high) // 2
        if passes(mid):
            high = mid
        else:
            low = mid + 1
    return low


def samples_to_pass(n_bad: int, max_bad_fraction: float, confidence: float) -> int | None:
    """The smallest sample size n at which `n_bad` bad samples pass `binomial_verdict`: the
    run size that would decide the claim if every further sample were good. None when no
    size can (a zero allowed fraction with a bad sample). With no bad sample, a 1% allowance
    and 99% confidence this is MLPerf's 459 (0.99^459 <= 0.01 < 0.99^458)."""
    if max_bad_fraction >= 1:
        return max(n_bad, 1)
    if max_bad_fraction <= 0:
        return None if n_bad else 1
    from scipy import stats as scipy_stats

    alpha = 1 - confidence

    def passes(n: int) -> bool:
        return bool(scipy_stats.binom.cdf(n_bad, n, max_bad_fraction) <= alpha)

    high = max(n_bad, 1)
    while not passes(high):  # the CDF falls as n grows: double, then bisect
        high *= 2
    low = high // 2
    while low + 1 < high:
        mid = (low + high) // 2
        if passes(mid):
            high = mid
        else:
            low = mid
    return high


def binomial_verdict(n_bad: int, n: int, max_bad_fraction: float, confidence: float) -> str:
    """pass, fail or inconclusive for the claim "the true bad fraction <= max_bad_fraction".

    pass: BinomCDF(n_bad; n, f) <= 1 - c (too few bad samples for f to be the true rate,
    MLPerf's early-stopping criterion); fail: P(X >= n_bad; n, f) <= 1 - c (too many);
    otherwise inconclusive. With f = 0 no sample size proves the claim: the verdict is
    pass on zero bad samples (an observation, not a bound) and fail otherwise. n = 0 is
    inconclusive.
    """
    if n <= 0:
        return INCONCLUSIVE
    if max_bad_fraction <= 0:
        return PASS if n_bad == 0 else FAIL
    if max_bad_fraction >= 1:
        return PASS
    alpha = 1 - confidence
    from scipy import stats as scipy_stats  # here: importing slo stays light

    if scipy_stats.binom.cdf(n_bad, n, max_bad_fraction) <= alpha:
        return PASS
    if n_bad > 0 and scipy_stats.binom.sf(n_bad - 1, n, max_bad_fraction) <= alpha:
        return FAIL
    return INCONCLUSIVE
