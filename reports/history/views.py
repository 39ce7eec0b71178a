"""Console views of the history (rich tables) and the JSON form of a trend-gate result; the CLI
prints them, nothing here prints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    from reports.history.record import HistoryRun
    from reports.history.trend import TrendGateResult
    from reports.history.trend_card import MetricTrend

VERDICT_STYLES = {"pass": "green", "regressed": "red", "improved": "cyan", "inconclusive": "yellow"}


def _num(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:.{digits}g}"


def _ci(low, high) -> str:
    return "" if low is None or high is None else f"[{_num(low)}, {_num(high)}]"


def series_table(groups: dict[str, list[HistoryRun]]) -> Table:
    """One row per series: id, what it is, how many runs, first and latest start."""
    table = Table(title="series in the history")
    for column in ("series", "workload · target · model · hardware", "runs", "first", "latest"):
        table.add_column(column, justify="right" if column == "runs" else "left")
    for series_id, runs in groups.items():
        starts = [r.started_at for r in runs if r.started_at is not None]
        table.add_row(series_id, runs[0].key.label, str(len(runs)),
                      str(min(starts)) if starts else "—", str(max(starts)) if starts else "—")  # fmt: skip
    return table


def runs_table(runs: list[HistoryRun]) -> Table:
    """One row per run: id, series, start, TTFT p99, output tokens/s, whether its directory is
    still on disk."""
    table = Table(title=f"{len(runs)} runs")
    for column in ("run", "series", "started (UTC)", "TTFT p99 ms", "output tokens/s", "directory"):
        table.add_column(column)
    for run in runs:
        ttft, tokens = run.metrics.get("ttft_p99_ms"), run.metrics.get("output_tokens_per_s")
        table.add_row(
            run.run_id,
            run.key.series_id,
            str(run.started_at or "—"),
            _num(ttft.value if ttft else None),
            _num(tokens.value if tokens else None),
            "present" if Path(run.run_dir).is_dir() else "deleted",
        )
    return table


def trend_table(trend: MetricTrend, label: str) -> Table:
    """The runs of one series for one metric, each with its interval; shifts marked."""
    metric = trend.metric
    table = Table(title=f"{metric.label} ({metric.unit or 'fraction'}) · {label}")
    for column in ("#", "run", "started (UTC)", "value", "95% interval", "shift"):
        table.add_column(column)
    shifts = {s.index: s for s in trend.shifts}
    for i, p in enumerate(trend.points):
        shift = shifts.get(i)
        mark = ""
        if shift is not None:
            word = "worse" if shift.worse else "better"
            mark = f"[{'red' if shift.worse else 'cyan'}]{shift.change:+.1%} ({word}, p={shift.p_value:.3f})[/]"
        table.add_row(str(i + 1), p.run_id, str(p.started_at or "—"), _num(p.value),
                      _ci(p.ci_low, p.ci_high), mark)  # fmt: skip
    return table


def gate_table(result: TrendGateResult) -> Table:
    """Per metric: candidate [interval], baseline median over n runs, verdict, reason."""
    style = VERDICT_STYLES.get(result.verdict, "")
    table = Table(
        title=f"trend gate: {result.candidate} against {len(result.window)} recent runs · "
        f"[{style}]{result.verdict}[/]",
        caption=result.series,
    )
    for column in (
        "metric",
        "candidate",
        "95% interval",
        "baseline median",
        "runs",
        "verdict",
        "why",
    ):
        table.add_column(column)
    for r in result.results:
        ci = _ci(*r.candidate_ci) if r.candidate_ci else ""
        table.add_row(r.label, _num(r.candidate), ci, _num(r.baseline_median),
                      str(len(r.baseline_runs)), f"[{VERDICT_STYLES[r.verdict]}]{r.verdict}[/]",
                      r.reason)  # fmt: skip
    return table


def gate_dict(result: TrendGateResult) -> dict:
    """The trend gate's result as JSON-ready data."""
    return {
        "kind": "trend_gate",
        "candidate": result.candidate,
        "series": result.series,
        "window": result.window,
        "verdict": result.verdict,
        "exit_code": result.exit_code,
        "notes": result.notes,
        "results": [
            {
                "metric": r.metric,
                "candidate": r.candidate,
                "candidate_ci": list(r.candidate_ci) if r.candidate_ci else None,
                "baseline_median": r.baseline_median,
                "baseline_runs": r.baseline_runs,
                "change": None if r.change is None or not math.isfinite(r.change) else r.change,
                "verdict": r.verdict,
                "reason": r.reason,
                "shift_run_id": r.shift_run_id,
            }
            for r in result.results
        ],
    }
