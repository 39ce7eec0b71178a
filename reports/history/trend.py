"""Trends over a series of comparable runs, and the trend gate: a new run judged against the
history's recent runs rather than against one baseline run.

A shift (`Shift`) is a change point that E-divisive means finds (`reports.history.changepoint`)
and that also matters: the median of the runs after it differs from the median of the runs
before it (back to the previous change point) by more than the metric's relative threshold
and its noise floor (`reports.history.catalogue`), and by more than the runs before it vary
by themselves (the median half-width of their 95% intervals). Significant but negligible
shifts are dropped and the segments on either side merged, so a long, quiet history of
many metrics does not grow change points from noise.

The trend gate takes the `window` most recent comparable runs before the candidate (same
series; default 20) and, per metric:

1. the baseline is the window's runs since its last shift (an old regression that the history
   already shows is the new normal, not the candidate's fault);
2. regressed (improved): adding the candidate reveals a new shift, after the baseline began,
   whose later level is worse (better): the candidate belongs to a new level that other runs
   share. The result names the first run of that level. The change-point test runs at the
   significance divided by the number of metrics judged (Bonferroni), so the gate as a whole,
   not each metric, keeps the false-alarm rate; with 11 metrics and 20 runs a new level needs
   about three runs to be told from two unlucky ones;
3. inconclusive: the candidate alone is worse than the baseline's median beyond the threshold
   and floor, and its interval lies beyond every baseline run's figure (with fewer than
   `FEW_RUNS` baseline runs, beyond their intervals too). One run cannot make a change point:
   the next runs confirm it (2) or clear it (4);
4. pass: otherwise (within the threshold, or within the recent runs' spread).

No comparable run in the window, or no figure for any metric, is inconclusive. The gate's
verdict is regressed if any metric regressed, else inconclusive if any was, else pass; exit
codes are the two-run gate's (0 pass, 1 regression, 3 inconclusive; 2 a usage error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from reports.gate import EXIT_CODES, overall_verdict
from reports.history.catalogue import DEFAULT_GATE_METRICS, HistoryMetric, resolve_metric
from reports.history.changepoint import (
    DEFAULT_MIN_SIZE,
    DEFAULT_SIGNIFICANCE,
    e_divisive,
)
from reports.history.record import HistoryRun

DEFAULT_WINDOW = 20
FEW_RUNS = 3


@dataclass(frozen=True)
class TrendConfig:
    """How shifts are found and the trend gate judges. `metrics` are catalogue keys (or names
    without the unit suffix); `seed` seeds the permutation tests."""

    metrics: tuple[str, ...] = DEFAULT_GATE_METRICS
    window: int = DEFAULT_WINDOW
    significance: float = DEFAULT_SIGNIFICANCE
    permutations: int = 999
    min_size: int = DEFAULT_MIN_SIZE
    seed: int = 0
    detect: bool = True  # False: no change-point search (the negative control of the tests)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError("window must be at least 1 run.")
        if not 0 < self.significance < 1:
            raise ValueError("significance must be between 0 and 1.")
        object.__setattr__(self, "metrics", tuple(resolve_metric(m).key for m in self.metrics))

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


@dataclass(frozen=True)
class Shift:
    """A change of level at `index` (the first run of the new level) of a series."""

    index: int
    before: float  # median of the runs since the previous shift
    after: float  # median of the runs up to the next shift
    p_value: float
    worse: bool

    @property
    def change(self) -> float:
        """after / before - 1 (NaN when `before` is 0)."""
        return self.after / self.before - 1 if self.before else math.nan


def _beyond(before: float, after: float, metric: HistoryMetric) -> bool:
    """Whether after differs from before by more than the metric's threshold and floor."""
    if abs(after - before) <= metric.noise_floor:
        return False
    if before == 0:
        return after != 0
    return abs(after / before - 1) > metric.relative_threshold + 1e-12  # exactly at it: not beyond


def half_widths(points) -> np.ndarray:
    """Half the width of each `MetricPoint`'s interval (NaN where it has none)."""
    return np.array(
        [
            np.nan if p.ci_low is None or p.ci_high is None else (p.ci_high - p.ci_low) / 2
            for p in points
        ]  # fmt: skip
    )


def _noise(widths: np.ndarray | None, start: int, end: int) -> float:
    """The median half-width over runs start..end-1 with an interval (0 when none has one)."""
    if widths is None:
        return 0.0
    known = widths[start:end][~np.isnan(widths[start:end])]
    return float(np.median(known)) if known.size else 0.0


def find_shifts(
    values, metric: HistoryMetric, config: TrendConfig, rng, widths: np.ndarray | None = None
) -> list[Shift]:
    """The shifts of the series `values` (oldest first) as this module's docstring defines;
    `widths` are the runs' interval half-widths (`half_widths`; None: not checked)."""
    z = np.asarray(values, dtype=np.float64)
    if not config.detect or z.size < 2 * config.min_size:
        return []
    points = e_divisive(
        z,
        rng=rng,
        min_size=config.min_size,
        permutations=config.permutations,
        significance=config.significance,
    )
    kept = [(c.index, c.p_value) for c in points]
    while True:
        bounds = [0, *(i for i, _ in kept), z.size]
        shifts = []
        for j, (index, p_value) in enumerate(kept):
            before = float(np.median(z[bounds[j] : index]))
            after = float(np.median(z[index : bounds[j + 2]]))
            worse = after < before if metric.higher_is_better else after > before
            shifts.append(Shift(index, before, after, p_value, worse))
        small = [
            s
            for j, s in enumerate(shifts)
            if not _beyond(s.before, s.after, metric)
            or abs(s.after - s.before) <= _noise(widths, bounds[j], s.index)
        ]
        if not small:
            return shifts
        weakest = min(small, key=lambda s: abs(s.after - s.before))
        kept = [(i, p) for i, p in kept if i != weakest.index]


@dataclass(frozen=True)
class TrendMetricResult:
    """The trend gate's judgement of one metric. `baseline_runs` are the run ids the candidate
    was compared with; `shift_run_id` names the first run of a new level (regressed/improved)."""

    metric: str
    label: str
    unit: str
    candidate: float
    candidate_ci: tuple[float, float] | None
    baseline_median: float | None
    baseline_runs: list[str]
    verdict: str
    reason: str
    shift_run_id: str | None = None
    change: float | None = None


@dataclass(frozen=True)
class TrendGateResult:
    """All metric results and the overall verdict (`exit_code` follows the gate's codes)."""

    candidate: str
    series: str
    window: list[str]
    results: list[TrendMetricResult]
    verdict: str
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.verdict, 0)


def comparable_before(history: list[HistoryRun], candidate: HistoryRun) -> list[HistoryRun]:
    """The history's runs of the candidate's series that came before it, oldest first: those
    listed before it when it is in the history, else those started no later than it."""
    series = [r for r in history if r.key.series_id == candidate.key.series_id]
    ids = [r.run_id for r in series]
    if candidate.run_id in ids:
        return series[: ids.index(candidate.run_id)]
    if candidate.started_at is None:
        return series
    return [r for r in series if r.started_at is None or r.started_at <= candidate.started_at]


def _judge(metric, window: list[HistoryRun], candidate: HistoryRun, config, rng):
    point = candidate.metrics[metric.key]
    usable = [r for r in window if metric.key in r.metrics]
    base_points = [r.metrics[metric.key] for r in usable]
    values = [p.value for p in base_points]
    widths = half_widths([*base_points, point])
    ci = None if point.ci_low is None else (point.ci_low, point.ci_high)
    base_shifts = find_shifts(values, metric, config, rng, widths[:-1])
    start = base_shifts[-1].index if base_shifts else 0
    baseline = values[start:]
    common = dict(metric=metric.key, label=metric.label, unit=metric.unit, candidate=point.value,
                  candidate_ci=ci, baseline_runs=[r.run_id for r in usable[start:]])  # fmt: skip
    if not baseline:
        return TrendMetricResult(**common, baseline_median=None, verdict="inconclusive",
                                 reason="no comparable run in the history has this figure")  # fmt: skip
    median = float(np.median(baseline))
    shifts = find_shifts([*values, point.value], metric, config, rng, widths)
    new = [s for s in shifts if s.index > start + 1]
    if new:
        shift = new[-1]
        first = usable[shift.index].run_id if shift.index < len(usable) else candidate.run_id
        verdict = "regressed" if shift.worse else "improved"
        return TrendMetricResult(
            **common, baseline_median=median, verdict=verdict, shift_run_id=first,
            change=shift.change,
            reason=f"level changed {shift.change:+.1%} from run {first} on "
                   f"(median {shift.before:.4g} -> {shift.after:.4g} {metric.unit}, p = {shift.p_value:.3f})",
        )  # fmt: skip
    change = point.value / median - 1 if median else math.nan
    worse = point.value < median if metric.higher_is_better else point.value > median
    # what the candidate must clear: each recent run's figure, and with fewer than
    # FEW_RUNS of them each one's interval too (one or two runs say little of the spread)
    edges = [
        (p.value, p.value) if p.ci_low is None or len(baseline) >= FEW_RUNS
        else (min(p.value, p.ci_low), max(p.value, p.ci_high))
        for p in base_points[start:]
    ]  # fmt: skip
    own = ci or (point.value, point.value)
    if metric.higher_is_better:
        outside = own[1] < min(low for low, _ in edges)
    else:
        outside = own[0] > max(high for _, high in edges)
    if worse and outside and _beyond(median, point.value, metric):
        return TrendMetricResult(
            **common, baseline_median=median, verdict="inconclusive", change=change,
            reason=f"{change:+.1%} against the median of {len(baseline)} recent runs, beyond all of "
                   "them, but one run is not yet a change point: the next run confirms or clears it",
        )  # fmt: skip
    return TrendMetricResult(
        **common, baseline_median=median, verdict="pass", change=change,
        reason=f"{change:+.1%} against the median of {len(baseline)} recent runs",
    )  # fmt: skip


def trend_gate(
    history: list[HistoryRun], candidate: HistoryRun, config: TrendConfig | None = None
) -> TrendGateResult:
    """Judge `candidate` against the `config.window` comparable runs before it in `history`
    (all runs, oldest first, as `HistoryStore.runs` returns them), by this module's rules."""
    config = config or TrendConfig()
    config = replace(config, significance=config.significance / max(1, len(config.metrics)))
    rng = config.rng()
    window = comparable_before(history, candidate)[-config.window :]
    notes = []
    if not window:
        notes.append(
            "no comparable run in the history (same workload, target, model and hardware); "
            "add runs with `bench history add`"
        )
    results = []
    for key in config.metrics:
        metric = resolve_metric(key)
        if key not in candidate.metrics:
            notes.append(f"{key} skipped: the candidate has no figure (goodput needs an SLO)")
            continue
        if window:
            results.append(_judge(metric, window, candidate, config, rng))
    overall = overall_verdict(results)
    return TrendGateResult(
        candidate=candidate.run_id,
        series=candidate.key.label,
        window=[r.run_id for r in window],
        results=results,
        verdict=overall,
        notes=notes,
    )
