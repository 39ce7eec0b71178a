"""Over-saturation: the target cannot keep up when TTFT and the number of requests in flight
keep rising together while requests are still being sent (a queue that only grows).

The rule, over the sent requests in send order (at least `MIN_REQUESTS`, with TTFT from the
ok ones): split them into four quarters of equal count; the run is over-saturated when, from
the first quarter to the last, the median TTFT at least doubles and grows by at least
`MIN_TTFT_RISE_MS`, the median in-flight count at dispatch grows by at least half and by at
least `MIN_IN_FLIGHT_RISE` requests, and both rise steadily: the Spearman rank correlation
of each with the send order is at least `MIN_RANK_CORRELATION`. A steady state, however
slow, keeps its TTFT flat; a burst that drains keeps it from rising to the end. GuideLLM
stops a benchmark on a similar test (its over-saturation constraint); here the finding is
a sentence on the console and the card. Runs that stream no tokens have no TTFT: not judged.
"""

from __future__ import annotations

import numpy as np

from slo.frame import RequestMetrics
from slo.slices import in_flight_at_send

MIN_REQUESTS = 20
MIN_TTFT_GROWTH = 2.0  # last-quarter median TTFT / first-quarter median
MIN_TTFT_RISE_MS = 50.0
MIN_IN_FLIGHT_GROWTH = 1.5
MIN_IN_FLIGHT_RISE = 2.0
MIN_RANK_CORRELATION = 0.5
RULE = (
    f"first to last quarter of sends: median TTFT x{MIN_TTFT_GROWTH:g} and "
    f"+{MIN_TTFT_RISE_MS:g} ms, median in-flight count x{MIN_IN_FLIGHT_GROWTH:g} and "
    f"+{MIN_IN_FLIGHT_RISE:g}, both rank-correlated with send order (rho >= "
    f"{MIN_RANK_CORRELATION:g}); at least {MIN_REQUESTS} requests"
)


def rank_correlation(x: np.ndarray, y: np.ndarray) -> float | None:
    """Spearman's rho of the pairs where both are defined (average ranks for ties); None with
    fewer than three pairs or a constant side."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = ~np.isnan(x) & ~np.isnan(y)
    x, y = x[keep], y[keep]
    if x.size < 3:
        return None
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(values.size)
    ranks[order] = np.arange(values.size, dtype=float)
    for value in np.unique(values[np.r_[False, np.diff(np.sort(values)) == 0]]):
        tied = values == value  # average the ranks of ties
        ranks[tied] = ranks[tied].mean()
    return ranks


def _median(values: np.ndarray) -> float | None:
    values = values[~np.isnan(values)]
    return float(np.median(values)) if values.size else None


def saturation_summary(rm: RequestMetrics) -> dict:
    """The `saturation` block: `{judged, saturated, sentence, n, ttft_first_ms, ttft_last_ms,
    in_flight_first, in_flight_last, rho_ttft, rho_in_flight, rule}` (see the module
    docstring); `judged` is false (and `saturated` None) with too few requests or no TTFT."""
    sent = rm.t_sent_ns
    has_sent = ~np.isnan(sent)
    order = np.argsort(np.where(has_sent, sent, np.inf), kind="stable")[: int(has_sent.sum())]
    in_flight = in_flight_at_send(rm.t_sent_ns, rm.t_done_ns)[order]
    ttft = np.where(rm.is_ok, rm.ttft_ms, np.nan)[order]
    return judge_saturation(ttft, in_flight)


def judge_saturation(ttft_ms, in_flight) -> dict:
    """The rule of the module docstring on sent requests in send order: `ttft_ms` (NaN where
    a request has none) and `in_flight` (other requests in flight at its send). Used on the
    recorded run by `saturation_summary` and live by `bench run --stop-on-saturation`."""
    ttft = np.asarray(ttft_ms, float)
    in_flight = np.asarray(in_flight, float)
    n = int(ttft.size)
    out = {"judged": False, "saturated": None, "sentence": None, "n": n, "rule": RULE}
    if n < MIN_REQUESTS or np.isnan(ttft).sum() > n - MIN_REQUESTS // 2:
        out["sentence"] = "not judged: too few requests with a TTFT"
        return out
    quarters = np.array_split(np.arange(n), 4)
    first, last = quarters[0], quarters[-1]
    ttft_first, ttft_last = _median(ttft[first]), _median(ttft[last])
    flight_first, flight_last = _median(in_flight[first]), _median(in_flight[last])
    position = np.arange(n, dtype=float)
    rho_ttft = rank_correlation(position, ttft)
    rho_flight = rank_correlation(position, in_flight)
    out.update(judged=ttft_first is not None and ttft_last is not None,
               ttft_first_ms=ttft_first, ttft_last_ms=ttft_last, in_flight_first=flight_first,
               in_flight_last=flight_last, rho_ttft=rho_ttft, rho_in_flight=rho_flight)  # fmt: skip
    if not out["judged"]:
        out["sentence"] = "not judged: a quarter of the run has no TTFT"
        return out
    ttft_rises = (
        ttft_last >= MIN_TTFT_GROWTH * ttft_first and ttft_last - ttft_first >= MIN_TTFT_RISE_MS
    )
    flight_rises = (
        flight_last >= MIN_IN_FLIGHT_GROWTH * flight_first
        and flight_last - flight_first >= MIN_IN_FLIGHT_RISE
    )
    steady = all(rho is not None and rho >= MIN_RANK_CORRELATION for rho in (rho_ttft, rho_flight))
    out["saturated"] = bool(ttft_rises and flight_rises and steady)
    if out["saturated"]:
        out["sentence"] = (
            f"The target cannot keep up: median TTFT rose from {ttft_first:.0f} ms to "
            f"{ttft_last:.0f} ms while requests in flight rose from {flight_first:g} to "
            f"{flight_last:g} (first to last quarter of sends); the offered load is above "
            "what it serves, so latencies describe a growing queue."
        )
    else:
        out["sentence"] = "no over-saturation: TTFT and the in-flight count did not rise together"
    return out


__all__ = ["judge_saturation", "rank_correlation", "saturation_summary"]
