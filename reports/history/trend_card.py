"""The trend card: per series, one chart per metric of each run's figure over time with its
interval, the shifts the history shows marked; as data (`MetricTrend`, for `bench history show`
and its JSON) and as a self-contained HTML page (inline SVG from `reports.charts`, the report
card's CSS, no scripts, nothing fetched)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import matplotlib

from reports.charts import CHART_RC, RUN_COLOURS, figure_svg, new_figure
from reports.history.catalogue import HistoryMetric, resolve_metric
from reports.history.record import HistoryRun
from reports.history.trend import Shift, TrendConfig, find_shifts, half_widths
from reports.html import card_environment
from reports.templates import PAGE_HEAD, PAGE_MACROS


@dataclass(frozen=True)
class TrendPoint:
    run_id: str
    started_at: datetime | None
    value: float
    ci_low: float | None
    ci_high: float | None


@dataclass(frozen=True)
class MetricTrend:
    """One metric of one series: its points (oldest first) and shifts (indexes into points)."""

    metric: HistoryMetric
    points: list[TrendPoint]
    shifts: list[Shift]

    def to_dict(self) -> dict:
        """JSON form: {metric, unit, points[{run_id, started_at, value, ci_low, ci_high}],
        shifts[{run_id, index, before, after, change, p_value, worse}]}."""
        return {
            "metric": self.metric.key,
            "unit": self.metric.unit,
            "points": [
                {
                    "run_id": p.run_id,
                    "started_at": p.started_at.isoformat() if p.started_at else None,
                    "value": p.value,
                    "ci_low": p.ci_low,
                    "ci_high": p.ci_high,
                }  # fmt: skip
                for p in self.points
            ],
            "shifts": [
                dict(
                    run_id=self.points[s.index].run_id,
                    index=s.index,
                    before=s.before,
                    after=s.after,
                    change=s.change,
                    p_value=s.p_value,
                    worse=s.worse,
                )
                for s in self.shifts
            ],
        }


def metric_trend(runs: list[HistoryRun], metric: HistoryMetric, config: TrendConfig) -> MetricTrend:
    """The trend of `metric` over `runs` (one series, oldest first); runs without the figure
    are left out."""
    points = [
        TrendPoint(r.run_id, r.started_at, p.value, p.ci_low, p.ci_high)
        for r in runs
        if (p := r.metrics.get(metric.key)) is not None
    ]
    values = [p.value for p in points]
    shifts = find_shifts(values, metric, config, config.rng(), half_widths(points))
    return MetricTrend(metric=metric, points=points, shifts=shifts)


def _x(points: list[TrendPoint]):
    """Start times when every point has a distinct one, else the run's position (1-based)."""
    times = [p.started_at for p in points]
    if all(t is not None for t in times) and len(set(times)) == len(times):
        return times, "run start (UTC)"
    return list(range(1, len(points) + 1)), "run (oldest first)"


def trend_svg(trend: MetricTrend) -> str | None:
    """Each run's figure with its interval as an error bar, the level of each segment between
    shifts as a step, and a dashed line at each shift; None without points."""
    if not trend.points:
        return None
    xs, xlabel = _x(trend.points)
    ys = [p.value for p in trend.points]
    low = [max(0.0, p.value - p.ci_low) if p.ci_low is not None else 0.0 for p in trend.points]
    high = [max(0.0, p.ci_high - p.value) if p.ci_high is not None else 0.0 for p in trend.points]
    with matplotlib.rc_context(CHART_RC):
        fig = new_figure(6.4, 3.0)
        ax = fig.add_subplot()
        ax.errorbar(xs, ys, yerr=[low, high], fmt="o", ms=3, color=RUN_COLOURS[0], ecolor="#7aa6c8",
                    capsize=2, label="run (95% interval)")  # fmt: skip
        bounds = [0, *(s.index for s in trend.shifts), len(ys)]
        levels = [trend.shifts[0].before] if trend.shifts else []
        levels += [s.after for s in trend.shifts]
        for j, level in enumerate(levels):
            segment = xs[bounds[j] : bounds[j + 1]]
            ax.plot([segment[0], segment[-1]], [level, level], color=RUN_COLOURS[1], lw=1.2,
                    label="level (median)" if j == 0 else None)  # fmt: skip
        for s in trend.shifts:
            ax.axvline(xs[s.index], color=RUN_COLOURS[1], ls="--", lw=1)
            ax.annotate(f"{s.change:+.0%}", xy=(xs[s.index], 1.0), xycoords=("data", "axes fraction"),
                        xytext=(2, -10), textcoords="offset points", fontsize=7)  # fmt: skip
        ax.set_title(trend.metric.label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(trend.metric.unit or trend.metric.label)
        if isinstance(xs[0], datetime):
            fig.autofmt_xdate()
        ax.legend(fontsize=7, frameon=False, loc="best")
        return figure_svg(fig)


TREND_TEMPLATE = (
    "{% set title = 'Trends: ' ~ (series | length) ~ ' series' %}"
    + PAGE_HEAD
    + PAGE_MACROS
    + """
<header>
<h1>Trends over the run history</h1>
<p class="sub">{{ series | length }} series · {{ total_runs }} runs · each point a run with its 95% interval;
dashed lines mark level shifts (E-divisive means, p &le; {{ significance }}, beyond the metric's threshold).</p>
</header>
{% for s in series %}
<h2>{{ s.label }}</h2>
<p class="sub">series {{ s.series_id }} · {{ s.runs | length }} runs{% for note in s.shift_notes %} · {{ note }}{% endfor %}</p>
{{ chart_grid(s.charts) }}
<details><summary>Runs</summary>
<table><tr><th class="text">run</th><th class="text">started (UTC)</th><th class="text">directory</th></tr>
{% for r in s.runs %}<tr><td class="text"><code>{{ r.run_id }}</code></td><td class="text">{{ r.started_at or "—" }}</td><td class="text"><code>{{ r.run_dir }}</code></td></tr>
{% endfor %}</table></details>
{% endfor %}
</body>
</html>
"""
)


def render_trend_html(
    groups: dict[str, list[HistoryRun]], metrics: tuple[str, ...], config: TrendConfig
) -> str:
    """The trend card of `groups` (series id -> runs, oldest first) for `metrics`, as a
    complete HTML document; a metric no run of a series has is left out of that series."""
    series = []
    for series_id, runs in groups.items():
        charts, notes = [], []
        for key in metrics:
            trend = metric_trend(runs, resolve_metric(key), config)
            if not trend.points:
                continue
            charts.append({"title": trend.metric.label, "svg": trend_svg(trend)})
            notes += [
                f"{trend.metric.label} {s.change:+.1%} from {trend.points[s.index].run_id}"
                for s in trend.shifts
            ]
        series.append({"series_id": series_id, "label": runs[0].key.label, "runs": runs,
                       "charts": charts, "shift_notes": notes})  # fmt: skip
    env = card_environment()
    return env.from_string(TREND_TEMPLATE).render(
        series=series,
        total_runs=sum(len(rs) for rs in groups.values()),
        significance=config.significance,
    )
