"""The regression gate: candidate against baseline, one verdict per metric.

For each metric the gate estimates candidate/baseline with a seeded bootstrap interval
(`slo.comparison.bootstrap_ratio`: requests are resampled, or whole runs when a side has
several repetitions) and, where the samples allow, a Mann-Whitney U test. The verdict of one
metric, with "worse" meaning higher for latencies and lower for rates:

1. inconclusive: too few samples on either side: fewer independent units (requests; whole
   runs count their requests) than `min_samples`, or fewer values than a tail quantile needs
   (100 for p99; pooled inter-token gaps count as values), or no ratio (a zero baseline
   against a different candidate beyond the noise floor); equal figures (zero against zero
   too) pass;
2. pass: the absolute change is within the metric's noise floor (e.g. 1 ms for latencies);
3. regressed: the ratio is worse than the relative threshold and the interval excludes 1;
4. inconclusive: the ratio is worse than the threshold but the interval includes 1;
5. improved: the ratio is better than the threshold and the interval excludes 1;
6. pass: otherwise (within the threshold, or an improvement that is not significant).

The gate's verdict is regressed if any metric regressed, else inconclusive if any metric was,
else pass. Exit codes: 0 pass, 1 regression, 3 inconclusive (2 is a usage error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from reports.build import client_bound_ms, read_manifest
from reports.compare import find_mismatches
from reports.errors import ReportError
from reports.gate_config import GateConfig, MetricSpec
from slo.comparison import RatioEstimate, Sample, Statistic, bootstrap_ratio, mann_whitney
from slo.errors import SLOError
from slo.frame import RequestMetrics
from slo.goodput import good_mask
from slo.runrecord import RunRecordError, open_run
from slo.spec import as_spec
from slo.summary import dispatch_summary

GATE_VERDICTS = ("pass", "regressed", "improved", "inconclusive")
EXIT_CODES = {"pass": 0, "regressed": 1, "inconclusive": 3}


@dataclass(frozen=True)
class MetricResult:
    """The comparison of one metric; `ratio` is candidate / baseline."""

    metric: str
    label: str
    unit: str
    higher_is_better: bool
    relative_threshold: float
    noise_floor: float
    estimate: RatioEstimate
    mann_whitney_p: float | None
    verdict: str
    reason: str


@dataclass(frozen=True)
class GateResult:
    """All metric results and the overall verdict (`exit_code` follows EXIT_CODES)."""

    baseline: list[str]
    candidate: list[str]
    slo_name: str | None
    results: list[MetricResult]
    verdict: str
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


def run_dirs_of(path: Path | str) -> list[Path]:
    """The run directories `path` stands for: itself when it holds `requests.parquet`,
    else its immediate subdirectories that do (repetitions), sorted by name.

    Raises ReportError when there are none."""
    path = Path(path)
    if (path / "requests.parquet").is_file():
        return [path]
    if path.is_dir():
        runs = sorted(p for p in path.iterdir() if (p / "requests.parquet").is_file())
        if runs:
            return runs
    raise ReportError(
        f"{path} is neither a run directory nor a directory of run directories; "
        "pass what `bench run --out` wrote."
    )


@dataclass(frozen=True)
class _RunData:
    rm: RequestMetrics
    window_s: float
    good: np.ndarray | None
    warnings: tuple[str, ...]


def _load(path: Path, slo_spec) -> _RunData:
    try:
        tables = open_run(path)
    except (SLOError, RunRecordError) as exc:
        raise ReportError(str(exc)) from exc
    rm = RequestMetrics.from_tables(tables.requests, tables.chunks)
    window_s = rm.window_s()
    if window_s is None:
        raise ReportError(f"{path} has no measured window (no request was sent and finished).")
    good = good_mask(rm, slo_spec) if slo_spec is not None else None
    warnings = []
    if tables.manifest is not None and tables.manifest.complete is False:
        reason = tables.manifest.interrupted_reason or "no reason recorded"
        warnings.append(f"run {path.name} is incomplete ({reason})")
    _, bound = dispatch_summary(rm, client_bound_ms(tables.manifest))
    if bound:
        warnings.append(
            f"run {path.name} was client bound: the load generator fell behind its schedule"
        )
    return _RunData(rm=rm, window_s=window_s, good=good, warnings=tuple(warnings))


def metric_sample(run: _RunData, metric: MetricSpec) -> Sample | None:
    """The per-request values feeding `metric` for one run (None when unavailable, e.g.
    goodput without an SLO). Latencies are over ok requests; rates take every request (a
    failed one contributes 0), so failures count against throughput. Inter-token gaps carry
    their request as group, so the bootstrap resamples requests, not gaps."""
    rm = run.rm
    ok = rm.is_ok
    if metric.source == "ok_requests":
        return Sample(ok.astype(float), run.window_s)
    if metric.source == "ok_output_tokens":
        return Sample(np.where(ok, np.nan_to_num(rm.output_tokens), 0.0), run.window_s)
    if metric.source == "good_requests":
        return None if run.good is None else Sample(run.good.astype(float), run.window_s)
    if metric.source == "itl":
        gaps = [rm.itl_by_request.get(r, np.empty(0)) for r in rm.request_id[ok]]
        groups = np.repeat(np.arange(len(gaps)), [g.size for g in gaps])
        values = np.concatenate(gaps) if gaps else np.empty(0)
        return Sample(values, run.window_s, groups=groups)
    values = getattr(rm, f"{metric.source}_ms")[ok]
    return Sample(values[~np.isnan(values)], run.window_s)


def judge(
    estimate: RatioEstimate,
    *,
    higher_is_better: bool,
    relative: float,
    floor: float,
    min_n: int,
    min_values: int = 0,
) -> tuple[str, str]:
    """(verdict, reason) for one metric by the rules in this module's docstring: `min_n` is
    the fewest units (requests) and `min_values` the fewest pooled values per side."""
    n = min(estimate.units_baseline, estimate.units_candidate)
    if n < min_n:
        return "inconclusive", f"too few samples ({n} < {min_n})"
    n_values = min(estimate.n_baseline, estimate.n_candidate)
    if n_values < min_values:
        return "inconclusive", f"too few samples ({n_values} < {min_values})"
    both_defined = math.isfinite(estimate.baseline) and math.isfinite(estimate.candidate)
    if both_defined and estimate.candidate == estimate.baseline:
        return "pass", "no change (equal figures)"  # zero against zero included
    if not math.isfinite(estimate.ratio):
        if both_defined and abs(estimate.candidate - estimate.baseline) <= floor:
            return (
                "pass",
                f"change {estimate.candidate - estimate.baseline:+g} is within the noise floor ({floor:g})",
            )
        return "inconclusive", "no ratio: the baseline figure is zero or undefined"
    change = estimate.ratio - 1.0
    worse_change = -change if higher_is_better else change
    ci_excludes_one = not (estimate.ci_low <= 1.0 <= estimate.ci_high)
    if abs(estimate.candidate - estimate.baseline) <= floor:
        return "pass", f"change {change:+.1%} is within the noise floor ({floor:g})"
    if worse_change > relative:
        if ci_excludes_one:
            return "regressed", f"{change:+.1%} is beyond the {relative:.0%} threshold"
        return (
            "inconclusive",
            f"{change:+.1%} is beyond the threshold but the interval includes no change",
        )
    if -worse_change > relative and ci_excludes_one:
        return "improved", f"{change:+.1%} is beyond the {relative:.0%} threshold"
    return "pass", f"change {change:+.1%} is within the {relative:.0%} threshold"


def _mwu_p(base: list[Sample], cand: list[Sample], metric: MetricSpec) -> float | None:
    if metric.statistic.kind == "rate":
        # One figure per run; the test needs repetitions on both sides.
        base_rates = [metric.statistic.compute(s.values, s.window_s) for s in base]
        cand_rates = [metric.statistic.compute(s.values, s.window_s) for s in cand]
        result = mann_whitney(np.array(base_rates), np.array(cand_rates), min_n=3)
    else:
        result = mann_whitney(
            np.concatenate([s.values for s in base]), np.concatenate([s.values for s in cand])
        )
    return None if result is None else result.p_value


def run_gate(
    baseline: Path | str,
    candidate: Path | str,
    *,
    config: GateConfig | None = None,
    slo_spec=None,
    allow_mismatch: bool = False,
) -> GateResult:
    """Compare `candidate` against `baseline` (each a run directory or a directory of
    repetitions). `slo_spec` (an SLOSpec, dict or name; None: the baseline manifest's SLO)
    defines goodput. Randomness comes from `config.seed`. Raises ReportError for unreadable
    runs and, unless `allow_mismatch`, for runs of different workloads."""
    config = config or GateConfig()
    base_dirs, cand_dirs = run_dirs_of(baseline), run_dirs_of(candidate)
    manifests = [(p.name, read_manifest(p)) for p in (*base_dirs, *cand_dirs)]
    notes = []
    mismatches = [m for m in find_mismatches(manifests) if "workload" in m]
    if mismatches and not allow_mismatch:
        raise ReportError(
            f"Refusing to gate runs of different workloads: {mismatches[0]}; "
            "pass --allow-mismatch to compare anyway."
        )
    notes += [f"mismatch allowed: {m}" for m in mismatches]
    raw_slo = slo_spec if slo_spec is not None else manifests[0][1].slo
    spec = as_spec(raw_slo) if raw_slo else None
    base_runs = [_load(p, spec) for p in base_dirs]
    cand_runs = [_load(p, spec) for p in cand_dirs]
    notes += [w for run in (*base_runs, *cand_runs) for w in run.warnings]
    rng = np.random.default_rng(config.seed)
    results = []
    for metric in config.metric_specs():
        base_samples = [metric_sample(r, metric) for r in base_runs]
        cand_samples = [metric_sample(r, metric) for r in cand_runs]
        if any(s is None for s in (*base_samples, *cand_samples)):
            notes.append(f"{metric.key} skipped: goodput needs an SLO (pass --slo)")
            continue
        estimate = bootstrap_ratio(
            base_samples,
            cand_samples,
            metric.statistic,
            rng=rng,
            n_resamples=config.n_resamples,
            confidence=config.confidence,
        )
        threshold = config.threshold_for(metric)
        verdict, reason = judge(
            estimate,
            higher_is_better=metric.higher_is_better,
            relative=threshold.relative,
            floor=threshold.floor,
            min_n=config.min_samples,
            min_values=metric.statistic.min_samples(config.min_samples),
        )
        results.append(
            MetricResult(
                metric=metric.key,
                label=metric.label,
                unit=metric.unit,
                higher_is_better=metric.higher_is_better,
                relative_threshold=threshold.relative,
                noise_floor=threshold.floor,
                estimate=estimate,
                mann_whitney_p=_mwu_p(base_samples, cand_samples, metric),
                verdict=verdict,
                reason=reason,
            )
        )
    overall = overall_verdict(results)
    return GateResult(
        baseline=[str(p) for p in base_dirs],
        candidate=[str(p) for p in cand_dirs],
        slo_name=None if spec is None else spec.name,
        results=results,
        verdict=overall,
        notes=notes,
    )


__all__ = ["GATE_VERDICTS", "GateResult", "MetricResult", "Statistic", "run_gate", "judge"]


def overall_verdict(results) -> str:
    """A gate's verdict from its metrics' (each has `.verdict`): regressed if any regressed,
    else inconclusive if any was or none was judged, else pass."""
    verdicts = {r.verdict for r in results}
    if "regressed" in verdicts:
        return "regressed"
    return "inconclusive" if "inconclusive" in verdicts or not results else "pass"
