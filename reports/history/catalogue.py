"""The figures the run history keeps per run, defined once: their keys, units, direction and
the thresholds the trend gate judges them by.

The keys follow the two-run gate's (`reports.gate_config`): `ttft_p99_ms`,
`output_tokens_per_s`, `goodput_request_per_s`, ... A name without its unit suffix
(`ttft_p99`) names the same figure, so `--metric ttft_p99` works as people type it.
Relative thresholds and latency noise floors are the two-run gate's defaults
(`DEFAULT_THRESHOLDS`, `DEFAULT_FLOORS_MS`); p90 is judged as a tail (the p99 class).
"""

from __future__ import annotations

from dataclasses import dataclass

from reports.errors import ReportError
from reports.gate_config import DEFAULT_FLOORS_MS, DEFAULT_THRESHOLDS

LATENCY_FAMILIES = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 99)
RATES = (
    ("request_per_s", "requests/s (finished ok)", "requests/s"),
    ("output_tokens_per_s", "output tokens/s (ok requests)", "tokens/s"),
    ("input_tokens_per_s", "input tokens/s (ok requests)", "tokens/s"),
    ("total_tokens_per_s", "total tokens/s (ok requests)", "tokens/s"),
)


@dataclass(frozen=True)
class HistoryMetric:
    """One kept figure. `family` is the latency family (ttft, tpot, itl, e2e) and `percentile`
    its percentile, None for rates; `threshold_class` keys `DEFAULT_THRESHOLDS`."""

    key: str
    label: str
    unit: str
    higher_is_better: bool
    threshold_class: str
    family: str | None = None
    percentile: int | None = None

    @property
    def relative_threshold(self) -> float:
        """The relative change (fraction) beyond which a shift counts."""
        return DEFAULT_THRESHOLDS[self.threshold_class].relative

    @property
    def noise_floor(self) -> float:
        """The absolute change (metric units) below which a shift never counts."""
        return DEFAULT_FLOORS_MS.get(self.family, 0.0) if self.family else 0.0


def _latency(family: str, q: int) -> HistoryMetric:
    return HistoryMetric(
        key=f"{family}_p{q}_ms",
        label=f"{family.upper()} p{q}",
        unit="ms",
        higher_is_better=False,
        threshold_class="p50" if q == 50 else "p99",
        family=family,
        percentile=q,
    )


HISTORY_METRICS = (
    *(_latency(f, q) for f in LATENCY_FAMILIES for q in PERCENTILES),
    *(HistoryMetric(k, label, unit, True, "throughput") for k, label, unit in RATES),
    HistoryMetric("goodput_request_per_s", "goodput (requests/s)", "requests/s", True, "goodput"),
    HistoryMetric("attainment", "SLO attainment (fraction of requests)", "", True, "goodput"),
)
BY_KEY = {m.key: m for m in HISTORY_METRICS}
# What the trend gate and the trend card look at unless told otherwise.
DEFAULT_GATE_METRICS = (
    "output_tokens_per_s",
    "request_per_s",
    "goodput_request_per_s",
    *(f"{f}_p{q}_ms" for f in LATENCY_FAMILIES for q in (50, 99)),
)
DEFAULT_REPORT_METRICS = (
    "ttft_p99_ms",
    "tpot_p99_ms",
    "itl_p99_ms",
    "e2e_p99_ms",
    "output_tokens_per_s",
    "goodput_request_per_s",
)


def resolve_metric(name: str) -> HistoryMetric:
    """The metric `name` names (`ttft_p99_ms`, or `ttft_p99` without the unit); ReportError
    naming the known keys otherwise."""
    key = name.strip().lower()
    metric = BY_KEY.get(key) or BY_KEY.get(f"{key}_ms")
    if metric is None:
        raise ReportError(
            f"unknown metric {name!r}; choose one of {', '.join(BY_KEY)} "
            "(the _ms suffix may be left out)."
        )
    return metric
