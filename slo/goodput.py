"""Attainment and goodput (DistServe's definition): requests that finished ok within every
per-request objective.

Attainment = good requests / all requests; goodput = good requests per second of the
measured window. Errors, timeouts, rejections, cancellations and unknown outcomes are
always misses, so a failure can only lower attainment.

Undefined metrics: an ok request without a TTFT or E2E misses a TTFT or E2E objective
(nothing shows it met it). TPOT and the longest ITL stall are undefined for a request with
fewer than two output tokens or token-bearing chunks; such a request had no decode phase,
so those two objectives are met vacuously (vLLM's goodput counts its TPOT as 0 likewise).
"""

from __future__ import annotations

import numpy as np

from slo.frame import RequestMetrics
from slo.spec import PerRequestObjectives, SLOSpec

# per-request objective field -> (RequestMetrics attribute, met when the value is undefined)
OBJECTIVE_METRICS = {
    "ttft_ms": ("ttft_ms", False),
    "tpot_ms": ("tpot_ms", True),
    "max_itl_ms": ("itl_max_ms", True),
    "e2e_ms": ("e2e_ms", False),
}


def _in_range(values: np.ndarray, bounds: tuple[float | None, float | None]) -> np.ndarray:
    low, high = bounds
    mask = np.ones(values.shape, bool)
    if low is not None:
        mask &= values >= low
    if high is not None:
        mask &= values < high
    if low is not None or high is not None:
        mask &= ~np.isnan(values)
    return mask


def thresholds_ms(rm: RequestMetrics, spec: SLOSpec) -> dict[str, np.ndarray]:
    """Per-request limit arrays (ms, NaN = no limit) after slice overrides.

    A request in several override slices takes the first matching override in spec order.
    """
    n = len(rm)
    limits = {
        key: np.full(n, np.nan if value is None else value)
        for key, value in vars(spec.per_request).items()
    }
    assigned = np.zeros(n, bool)
    for override in spec.slices:
        mask = _in_range(rm.input_tokens, override.input_tokens)
        mask &= _in_range(rm.output_tokens, override.output_tokens)
        mask &= ~assigned
        merged: PerRequestObjectives = spec.per_request.merged(override.per_request)
        for key, value in vars(merged).items():
            limits[key][mask] = np.nan if value is None else value
        assigned |= mask
    return limits


def objective_misses(rm: RequestMetrics, spec: SLOSpec) -> dict[str, np.ndarray]:
    """For each per-request objective with any limit: True where an ok request missed it."""
    ok = rm.is_ok
    misses = {}
    for key, limit in thresholds_ms(rm, spec).items():
        if np.all(np.isnan(limit)):
            continue
        attr, vacuous = OBJECTIVE_METRICS[key]
        value = getattr(rm, attr)
        limited = ~np.isnan(limit)
        undefined = np.isnan(value)
        with np.errstate(invalid="ignore"):
            over = value > limit
        missed = limited & (over | (undefined & (not vacuous)))
        misses[key] = ok & missed
    return misses


def good_mask(rm: RequestMetrics, spec: SLOSpec) -> np.ndarray:
    """True for requests that finished ok and met every per-request objective."""
    good = rm.is_ok.copy()
    for missed in objective_misses(rm, spec).values():
        good &= ~missed
    return good


def goodput_summary(rm: RequestMetrics, spec: SLOSpec, window_s: float | None) -> dict:
    """The `goodput` block of the summary.

    Keys: `attainment` (good / all requests, None with no requests), `good_requests`,
    `total_requests`, `request_per_s`, `output_tokens_per_s` and `total_tokens_per_s`
    (good requests and their tokens per second of `window_s`; None without a window),
    `misses` (requests not ok, and ok requests over each objective; one request can miss
    several), `definition`.
    """
    good = good_mask(rm, spec)
    n = len(rm)
    n_good = int(good.sum())
    out_tokens = float(np.nansum(rm.output_tokens[good]))
    in_tokens = float(np.nansum(rm.input_tokens[good]))
    rate = (lambda x: x / window_s) if window_s else (lambda x: None)
    misses = {"not_ok": int((~rm.is_ok).sum())}
    misses.update({k: int(v.sum()) for k, v in objective_misses(rm, spec).items()})
    return {
        "attainment": n_good / n if n else None,
        "good_requests": n_good,
        "total_requests": n,
        "request_per_s": rate(float(n_good)),
        "output_tokens_per_s": rate(out_tokens),
        "total_tokens_per_s": rate(in_tokens + out_tokens),
        "misses": misses,
        "definition": "requests that finished ok within every per-request objective, "
        "per second of the measured window; failures count as misses",
    }
