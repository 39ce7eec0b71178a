"""SLO verdicts: each objective gets a measured value, a seeded bootstrap interval and
pass, fail or inconclusive.

The verdict comes from the binomial rule in `slo.stats.binomial_verdict` (MLPerf's early
stopping, at the spec's `early_stopping_confidence`), so a small sample cannot pass a
p99 claim: with no sample over the limit, p99 at 99% confidence needs 459 samples. The
bootstrap interval (at `confidence`) is reported alongside to show the spread. Fewer
samples than the spec's `min_samples` cannot pass (the verdict is inconclusive), but a
failure the binomial test already proves stands: 60 of 64 requests over a p99 limit is a
fail however small the run.

Percentile objectives are judged over ok requests (their latency distribution; `n` says
how many); attainment and error-rate objectives over all requests, failures counted as
misses. For `itl_ms` the sample is every pooled chunk gap; gaps of one request are not
independent, so its binomial bound is optimistic (`max_itl_ms`, one value per request,
avoids that).
"""

from __future__ import annotations

import numpy as np

from slo import metrics
from slo.frame import RequestMetrics
from slo.goodput import good_mask
from slo.spec import PercentileObjective, SLOSpec
from slo.stats import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    binomial_verdict,
    bootstrap_proportion_ci,
    bootstrap_quantile_ci,
    samples_to_pass,
)


def metric_values_ms(rm: RequestMetrics, metric: str) -> np.ndarray:
    """The sample a percentile objective on `metric` is judged over (ok requests, ms)."""
    ok = rm.is_ok
    if metric == "itl_ms":
        return rm.pooled_itl_ms(ok)
    attr = {"ttft_ms": "ttft_ms", "tpot_ms": "tpot_ms", "e2e_ms": "e2e_ms",
            "max_itl_ms": "itl_max_ms"}[metric]  # fmt: skip
    values = getattr(rm, attr)[ok]
    return values[~np.isnan(values)]


def _ci(interval: tuple[float, float] | None) -> list[float] | None:
    return None if interval is None else [interval[0], interval[1]]


def _gate_min_samples(verdict: str, n: int, spec: SLOSpec) -> tuple[str, str | None]:
    if n < spec.min_samples and verdict != FAIL:
        return INCONCLUSIVE, f"{n} samples, fewer than min_samples {spec.min_samples}"
    return verdict, None


def _to_decide(verdict: str, n_bad: int, n: int, allowed: float, spec: SLOSpec) -> int | None:
    """For an inconclusive verdict: the sample size that would pass it if every further sample
    were good (at least `min_samples`); None otherwise, or when no size could."""
    if verdict != INCONCLUSIVE:
        return None
    needed = samples_to_pass(n_bad, allowed, spec.early_stopping_confidence)
    return None if needed is None else max(needed, spec.min_samples, n + 1)


def _with_needed(reason: str, needed: int | None, n: int) -> str:
    if needed is None:
        return reason
    return f"{reason}; {needed} samples with no further miss would pass ({needed - n} more)"


def percentile_verdict(
    rm: RequestMetrics, objective: PercentileObjective, spec: SLOSpec, rng: np.random.Generator
) -> dict:
    """Judge one percentile objective; see the module docstring."""
    if objective.metric == "itl_ms":  # pooled gaps: exact, or a sketch over the budget
        pooled = rm.pooled_itl(rm.is_ok)
        n, n_over = pooled.n, pooled.count_over(objective.max_ms)
        measured = pooled.percentile(objective.percentile)
        ci = pooled.interval(objective.percentile, rng=rng, confidence=spec.confidence, at_least=1)
        estimate = {"quantiles": pooled.method, "relative_error": pooled.relative_error}
    else:
        values = metric_values_ms(rm, objective.metric)
        n = int(values.size)
        n_over = int((values > objective.max_ms).sum())
        measured = metrics.percentile(values, objective.percentile)
        ci = bootstrap_quantile_ci(
            values, objective.percentile, rng=rng, confidence=spec.confidence
        )
        estimate = {}
    allowed = 1 - objective.percentile / 100
    verdict = binomial_verdict(n_over, n, allowed, spec.early_stopping_confidence)
    verdict, reason = _gate_min_samples(verdict, n, spec)
    needed = _to_decide(verdict, n_over, n, allowed, spec)
    return {
        "name": objective.name,
        "kind": "percentile",
        "metric": objective.metric,
        "percentile": objective.percentile,
        "threshold": objective.max_ms,
        "measured": measured,
        "ci": _ci(ci),
        "n": n,
        "n_bad": n_over,
        "allowed_bad_fraction": allowed,
        "verdict": verdict,
        "samples_to_pass": needed,
        "reason": _with_needed(
            reason or _reason(verdict, n_over, n, allowed, f"were over {objective.max_ms:g} ms"),
            needed,
            n,
        ),
        **estimate,
    }


def _reason(verdict: str, n_bad: int, n: int, allowed: float, missed: str = "missed") -> str:
    """Why, in words: "26 of 40 requests missed; at most 1% may" (plus, when inconclusive,
    that the samples cannot decide yet)."""
    if n == 0:
        return "no samples"
    what = f"{n_bad} of {n} requests {missed}; at most {allowed * 100:.3g}% may"
    if verdict == INCONCLUSIVE:
        return f"{what} (too few samples to decide yet)"
    return what


def rate_verdict(
    *, name: str, kind: str, bad: np.ndarray, allowed: float, measured_good: bool,
    spec: SLOSpec, rng: np.random.Generator, missed: str = "missed",
) -> dict:  # fmt: skip
    """Judge "fraction of `bad` requests <= allowed" (attainment and error-rate objectives).

    `measured` is the good fraction when `measured_good`, else the bad fraction.
    """
    n = int(bad.size)
    n_bad = int(bad.sum())
    verdict = binomial_verdict(n_bad, n, allowed, spec.early_stopping_confidence)
    verdict, reason = _gate_min_samples(verdict, n, spec)
    needed = _to_decide(verdict, n_bad, n, allowed, spec)
    flags = ~bad if measured_good else bad
    ci = bootstrap_proportion_ci(flags, rng=rng, confidence=spec.confidence)
    return {
        "name": name,
        "kind": kind,
        "threshold": 1 - allowed if measured_good else allowed,
        "measured": float(flags.mean()) if n else None,
        "ci": _ci(ci),
        "n": n,
        "n_bad": n_bad,
        "allowed_bad_fraction": allowed,
        "verdict": verdict,
        "samples_to_pass": needed,
        "reason": _with_needed(reason or _reason(verdict, n_bad, n, allowed, missed), needed, n),
    }


def overall_verdict(verdicts: list[str]) -> str:
    """fail if any objective fails, else inconclusive if any is or none was judged, else pass."""
    if not verdicts:
        return INCONCLUSIVE
    if FAIL in verdicts:
        return FAIL
    if INCONCLUSIVE in verdicts:
        return INCONCLUSIVE
    return PASS


def evaluate(rm: RequestMetrics, spec: SLOSpec, *, rng: np.random.Generator) -> dict:
    """The `slo` block of the summary: `{spec, verdict, objectives: [...]}`.

    Each objective: `name`, `kind` (percentile | attainment | error_rate), `threshold`,
    `measured`, `ci` ([low, high] or None), `n`, `n_bad`, `allowed_bad_fraction`,
    `verdict`, `reason`; percentile objectives add `metric` and `percentile`.
    """
    objectives = [percentile_verdict(rm, p, spec, rng) for p in spec.percentiles]
    if spec.attainment_min is not None:
        objectives.append(
            rate_verdict(
                name=f"attainment >= {spec.attainment_min * 100:g}% of requests",
                kind="attainment", missed="missed an objective or failed",
                bad=~good_mask(rm, spec), allowed=1 - spec.attainment_min,
                measured_good=True, spec=spec, rng=rng,
            )
        )  # fmt: skip
    if spec.error_rate_max is not None:
        objectives.append(
            rate_verdict(
                name=f"error_rate <= {spec.error_rate_max * 100:g}% of requests",
                kind="error_rate", missed="failed",
                bad=~rm.is_ok, allowed=spec.error_rate_max, measured_good=False,
                spec=spec, rng=rng,
            )
        )  # fmt: skip
    return {
        "spec": spec.to_dict(),
        "verdict": overall_verdict([o["verdict"] for o in objectives]),
        "objectives": objectives,
    }
