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

from dataclasses import dataclass, field, replace
from pathlib import Path

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from reports.errors import ReportError
from slo.comparison import Statistic


def _at(where: Where | str) -> Where:
    return ys.as_where(where, ReportError)


@dataclass(frozen=True)
class Threshold:
    """Allowed relative change (fraction, e.g. 0.05) and absolute noise floor (metric units)."""

    relative: float
    floor: float = 0.0

    def __post_init__(self) -> None:
        ys.number(
            self.relative,
            _at("relative"),
            minimum=0,
            below=10,
            what="a fraction",
            hint="such as 0.05",
        )
        ys.number(self.floor, _at("floor"), minimum=0, what="a noise floor")
        object.__setattr__(self, "relative", float(self.relative))
        object.__setattr__(self, "floor", float(self.floor))


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
        ys.keys(self.metric_thresholds, _at("metrics"), METRIC_KEYS)
        for i, key in enumerate(self.only):
            ys.enum_member(key, _at("only") / i, METRIC_KEYS)
        ys.keys(self.thresholds, _at("thresholds"), DEFAULT_THRESHOLDS, required=DEFAULT_THRESHOLDS)
        ys.number(self.min_samples, _at("min_samples"), minimum=1, integer=True)
        ys.number(self.confidence, _at("confidence"), minimum=0.5, below=1, hint="such as 0.95")
        ys.number(self.n_resamples, _at("n_resamples"), minimum=100, integer=True)
        ys.number(self.seed, _at("seed"), minimum=0, integer=True)

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


_SETTINGS = ("min_samples", "confidence", "n_resamples", "seed")
_KEYS = ("thresholds", "floors_ms", "metrics", "only", *_SETTINGS)


def _threshold(data, where: Where, base: Threshold | None) -> Threshold:
    data = ys.mapping(data, where)
    ys.keys(data, where, ("relative", "floor"), required=() if base else ("relative",))
    relative = data.get("relative", base.relative if base else None)
    floor = data.get("floor", base.floor if base else 0.0)
    with ys.relocating(where):
        return Threshold(relative, floor)


def _entries(data: dict, key: str, root: Where, known) -> dict:
    """The mapping under `key` (none: empty), each of its keys one of `known`."""
    entries = ys.mapping(data.get(key) or {}, root / key)
    ys.keys(entries, root / key, known)
    return entries


def load_gate_config(path: Path | str) -> GateConfig:
    """Read a thresholds YAML file (format in this module's docstring) over the defaults; an
    empty file gives the defaults.

    Raises ReportError for an unreadable file, bad YAML, an unknown key or a bad value, with
    the line of the key at fault."""
    data, root = ys.load_file(path, error=ReportError, what="thresholds file")
    data = ys.document(data, root, _KEYS, empty={})
    config = GateConfig()
    thresholds = dict(config.thresholds)
    for cls, value in _entries(data, "thresholds", root, DEFAULT_THRESHOLDS).items():
        thresholds[cls] = _threshold(value, root / "thresholds" / cls, thresholds[cls])
    floors_ms = dict(config.floors_ms)
    for family, value in _entries(data, "floors_ms", root, DEFAULT_FLOORS_MS).items():
        ys.number(value, root / "floors_ms" / family, minimum=0, what="a noise floor in ms")
        floors_ms[family] = float(value)
    base = replace(config, thresholds=thresholds, floors_ms=floors_ms)
    by_key = {m.key: m for m in METRICS}
    metric_thresholds = {
        key: _threshold(value, root / "metrics" / key, base.threshold_for(by_key[key]))
        for key, value in _entries(data, "metrics", root, METRIC_KEYS).items()
    }
    only = ys.sequence(data.get("only") or [], root / "only", what="a list of metric keys")
    settings = {k: data[k] for k in _SETTINGS if k in data}
    with ys.relocating(root):
        return replace(base, metric_thresholds=metric_thresholds, only=tuple(only), **settings)
