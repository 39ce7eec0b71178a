"""Gate configuration: which metrics the gate compares and how much change each may show.

Defaults: 5% for throughput, goodput and p50 latencies, 10% for p99 latencies, and an
absolute noise floor for latencies (a change smaller than the floor always passes): 1 ms for
TTFT and E2E, 0.1 ms for TPOT and ITL, whose typical values are ten times smaller.
A YAML file (`--thresholds FILE`) overrides any of them:

    thresholds:            # per class: allowed relative change (fraction)
      throughput: {relative: 0.05}
      goodput:    {relative: 0.05}
      p50:        {relative: 0.05}
      p99:        {relative: 0.10}
    floors_ms:             # absolute noise floor per latency metric, ms
      ttft: 1.0
      tpot: 0.1
      itl: 0.1
      e2e: 1.0
    metrics:               # per metric relative threshold and floor, wins over both
      ttft_p99_ms: {relative: 0.15, floor: 5.0}
    only: [ttft_p50_ms, ttft_p99_ms, output_tokens_per_s]   # compare just these
    min_samples: 20        # fewest requests per side (a p99 also needs 100 values)
    confidence: 0.95       # bootstrap interval level
    n_resamples: 2000
    seed: 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from reports.errors import ReportError
from slo.comparison import Statistic


@dataclass(frozen=True)
class Threshold:
    """Allowed relative change (fraction, e.g. 0.05) and absolute noise floor (metric units)."""

    relative: float
    floor: float = 0.0

    def __post_init__(self) -> None:
        if not (0 <= self.relative < 10 and math.isfinite(self.relative)):
            raise ReportError(
                f"a relative threshold must be a fraction such as 0.05, not {self.relative!r}."
            )
        if not (self.floor >= 0 and math.isfinite(self.floor)):
            raise ReportError(f"a noise floor must be a non-negative number, not {self.floor!r}.")


@dataclass(frozen=True)
class MetricSpec:
    """One gated metric: `source` names the per-request values (see `reports.gate`)."""

    key: str
    label: str
    unit: str
    source: str
    statistic: Statistic
    higher_is_better: bool
    threshold_class: str


def _latency(metric: str, q: int) -> MetricSpec:
    return MetricSpec(
        key=f"{metric}_p{q}_ms",
        label=f"{metric.upper()} p{q}",
        unit="ms",
        source=metric,
        statistic=Statistic("quantile", q / 100.0),
        higher_is_better=False,
        threshold_class=f"p{q}",
    )


METRICS = (
    MetricSpec("output_tokens_per_s", "output tokens/s (ok requests)", "tokens/s",
               "ok_output_tokens", Statistic("rate"), True, "throughput"),
    MetricSpec("request_per_s", "requests/s (finished ok)", "requests/s",
               "ok_requests", Statistic("rate"), True, "throughput"),
    MetricSpec("goodput_request_per_s", "goodput (requests/s)", "requests/s",
               "good_requests", Statistic("rate"), True, "goodput"),
    *(_latency(m, q) for m in ("ttft", "tpot", "itl", "e2e") for q in (50, 99)),
)  # fmt: skip
METRIC_KEYS = tuple(m.key for m in METRICS)
DEFAULT_THRESHOLDS = {
    "throughput": Threshold(0.05),
    "goodput": Threshold(0.05),
    "p50": Threshold(0.05),
    "p99": Threshold(0.10),
}
DEFAULT_FLOORS_MS = {"ttft": 1.0, "tpot": 0.1, "itl": 0.1, "e2e": 1.0}


@dataclass(frozen=True)
class GateConfig:
    """Thresholds per class and per metric, which metrics to compare, and the statistics'
    settings. `seed` seeds the bootstrap generator, so a gate run is repeatable."""

    thresholds: dict = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    floors_ms: dict = field(default_factory=lambda: dict(DEFAULT_FLOORS_MS))
    metric_thresholds: dict = field(default_factory=dict)
    only: tuple[str, ...] = ()
    min_samples: int = 20
    confidence: float = 0.95
    n_resamples: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [k for k in (*self.metric_thresholds, *self.only) if k not in METRIC_KEYS]
        if unknown:
            raise ReportError(
                f"unknown gate metric {unknown[0]!r}; known: {', '.join(METRIC_KEYS)}."
            )
        missing = [c for c in DEFAULT_THRESHOLDS if c not in self.thresholds]
        if missing:
            raise ReportError(f"the gate thresholds lack class {missing[0]!r}.")
        if not (isinstance(self.min_samples, int) and self.min_samples >= 1):
            raise ReportError(f"min_samples must be a positive integer, not {self.min_samples!r}.")
        if not 0.5 <= self.confidence < 1:
            raise ReportError(
                f"confidence must be in [0.5, 1), such as 0.95, not {self.confidence!r}."
            )
        if not (isinstance(self.n_resamples, int) and self.n_resamples >= 100):
            raise ReportError(f"n_resamples must be an integer >= 100, not {self.n_resamples!r}.")

    def metric_specs(self) -> list[MetricSpec]:
        """The metrics to compare, in METRICS order."""
        return [m for m in METRICS if not self.only or m.key in self.only]

    def threshold_for(self, metric: MetricSpec) -> Threshold:
        """The metric's own threshold when configured, else its class's relative threshold
        with the floor of its latency family (0 for rates)."""
        if metric.key in self.metric_thresholds:
            return self.metric_thresholds[metric.key]
        relative = self.thresholds[metric.threshold_class].relative
        return Threshold(relative, self.floors_ms.get(metric.source, 0.0))


def _threshold(data, where: str, base: Threshold | None) -> Threshold:
    if not isinstance(data, dict) or not set(data) <= {"relative", "floor"}:
        raise ReportError(f"{where} must be a mapping with 'relative' and optionally 'floor'.")
    relative = data.get("relative", base.relative if base else None)
    if relative is None:
        raise ReportError(f"{where} needs a 'relative' threshold such as 0.05.")
    floor = data.get("floor", base.floor if base else 0.0)
    for name, value in (("relative", relative), ("floor", floor)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ReportError(f"{where}.{name} must be a number, not {value!r}.")
    return Threshold(float(relative), float(floor))


def load_gate_config(path: Path | str) -> GateConfig:
    """Read a thresholds YAML file (format in this module's docstring) over the defaults.

    Raises ReportError for an unreadable file, bad YAML, an unknown key or a bad value."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ReportError(f"cannot read thresholds file {path} ({exc.strerror}).") from None
    except yaml.YAMLError:
        raise ReportError(f"{path} is not valid YAML; fix its syntax.") from None
    known = {
        "thresholds",
        "floors_ms",
        "metrics",
        "only",
        "min_samples",
        "confidence",
        "n_resamples",
        "seed",
    }
    if not isinstance(data, dict) or not set(data) <= known:
        extra = sorted(set(data) - known) if isinstance(data, dict) else ["(not a mapping)"]
        raise ReportError(
            f"{path} has unknown field {extra[0]!r}; known fields: {', '.join(sorted(known))}."
        )
    config = GateConfig()
    thresholds = dict(config.thresholds)
    for cls, value in (data.get("thresholds") or {}).items():
        if cls not in DEFAULT_THRESHOLDS:
            raise ReportError(
                f"{path}: unknown threshold class {cls!r}; known: {', '.join(DEFAULT_THRESHOLDS)}."
            )
        thresholds[cls] = _threshold(value, f"thresholds.{cls}", thresholds[cls])
    floors_ms = dict(config.floors_ms)
    for family, value in (data.get("floors_ms") or {}).items():
        if family not in DEFAULT_FLOORS_MS:
            raise ReportError(
                f"{path}: unknown floors_ms entry {family!r}; known: {', '.join(DEFAULT_FLOORS_MS)}."
            )
        floors_ms[family] = _threshold(
            {"relative": 0.0, "floor": value}, f"floors_ms.{family}", None
        ).floor
    base = replace(config, thresholds=thresholds, floors_ms=floors_ms)
    by_key = {m.key: m for m in METRICS}
    metric_thresholds = {}
    for key, value in (data.get("metrics") or {}).items():
        if key not in by_key:
            raise ReportError(
                f"{path}: unknown gate metric {key!r}; known: {', '.join(METRIC_KEYS)}."
            )
        metric_thresholds[key] = _threshold(
            value, f"metrics.{key}", base.threshold_for(by_key[key])
        )
    settings = {
        k: data[k] for k in ("min_samples", "confidence", "n_resamples", "seed") if k in data
    }
    return replace(
        base,
        metric_thresholds=metric_thresholds,
        only=tuple(data.get("only") or ()),
        **settings,
    )
