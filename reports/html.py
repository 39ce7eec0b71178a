"""Self-contained HTML cards: inline CSS, inline SVG charts, no scripts, nothing fetched.

`render_html(card)` renders one run; `render_comparison_html(comparison)` renders several runs
side by side (see `reports.compare`). Both use the same `Card` objects the console and JSON use.
"""

from __future__ import annotations

from importlib import resources

import jinja2

from reports import charts
from reports.bounds_view import (
    BOUND_COLUMNS,
    BOUNDS_NOTE,
    BOUNDS_TITLE,
    bound_rows,
    cost_sentence,
    energy_sentence,
)
from reports.card import LATENCY_METRICS, Card, goodput_figures
from reports.checks_view import correctness_sentence, rate_tables, server_metrics_rows
from reports.classes_view import (
    TENANT_COLUMNS,
    deadlines_sentence,
    fairness_sentence,
    tenant_rows,
)
from reports.conventions_view import convention_rows, conventions_sources
from reports.dense_view import DENSE_COLUMNS, dense_rows, dense_sentence
from reports.disaggregation_view import (
    DISAGGREGATION_COLUMNS,
    DISAGGREGATION_TITLE,
    disaggregation_rows,
    disaggregation_sentences,
)
from reports.faults_view import recovery_text
from reports.overload_view import (
    LITTLE_COLUMNS,
    LITTLE_NOTE,
    LITTLE_TITLE,
    PHASE_COLUMNS,
    PHASES_TITLE,
    little_rows,
    phase_rows,
    recovery_sentence,
    shedding_sentence,
)
from reports.reasoning_view import (
    REASONING_COLUMNS,
    REASONING_TITLE,
    reasoning_rows,
    reasoning_sentence,
)
from reports.sessions_view import SESSION_COLUMNS, session_rows, sessions_sentence
from reports.taxonomy import OUTCOME_KINDS
from reports.templates import COMPARISON_TEMPLATE, RUN_TEMPLATE


def fmt(value, digits: int = 2) -> str:
    """A number for a table cell: thousands separators, `digits` decimals, "—" for None."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def fmt_ci(interval, digits: int = 1) -> str:
    """The interval as "[low, high]" with `digits` decimals, or "" when there is none."""
    if not interval or interval[0] is None or interval[1] is None:
        return ""
    return f"[{interval[0]:,.{digits}f}, {interval[1]:,.{digits}f}]"


def fmt_bytes(value) -> str:
    """Bytes as GiB/MiB/KiB with one decimal; "—" for None."""
    if value is None:
        return "—"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(value) >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value:,.0f} B"


GOODPUT_LABELS = (
    ("request_per_s", "good requests/s"),
    ("output_tokens_per_s", "output tokens/s of good requests"),
    ("total_tokens_per_s", "total tokens/s of good requests"),
    ("attainment", "SLO attainment (good / all requests)"),
    ("good_requests", "good requests"),
    ("total_requests", "all requests"),
)
ENV_FIELDS = (
    "engine",
    "model",
    "target",
    "hardware",
    "harness",
    "versions",
    "workload",
    "workload sha256",
    "command line",
    "started / ended",
    "complete",
)


def environment_rows(env) -> dict[str, str]:
    """The environment as {ENV_FIELDS label: display text}."""
    hw = env.hardware
    memory = fmt_bytes(hw.get("memory_bytes")) if hw.get("memory_bytes") else "? memory"
    versions = ", ".join(f"{k} {v}" for k, v in env.versions.items())
    return {
        "engine": env.engine_line() if env.engine else "—",
        "model": env.model or "—",
        "target": f"{env.target_kind or '—'} {env.target_url or ''}".strip(),
        "hardware": f"{hw.get('cpu') or '—'}, {hw.get('cpu_count') or '?'} cores, {memory}, "
        f"GPU: {hw.get('gpu') or 'none'}",
        "harness": f"{env.harness_version or '—'} @ {(env.git_sha or '—')[:12]}",
        "versions": versions or "—",
        "workload": (env.workload_name or "—") + (" (synthetic)" if env.workload_synthetic else ""),
        "workload sha256": env.workload_sha256 or "—",
        "command line": env.command_line or "—",
        "started / ended": f"{env.started_at or '—'} / {env.ended_at or '—'}",
        "complete": "yes"
        if env.complete
        else f"no: {env.interrupted_reason or 'no reason recorded'}",
    }


def card_environment() -> jinja2.Environment:
    """The Jinja2 environment every HTML card renders in (the run, comparison and sweep
    cards): the number filters, the inline CSS (`card.css`) and the helpers the templates call;
    undefined names raise."""
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters.update(fmt=fmt, fmt_ci=fmt_ci, fmt_bytes=fmt_bytes)
    env.globals.update(
        css=(resources.files("reports") / "card.css").read_text(),
        LATENCY_METRICS=LATENCY_METRICS,
        OUTCOME_KINDS=OUTCOME_KINDS,
        METRIC_TITLES=charts.METRIC_TITLES,
        ENV_FIELDS=ENV_FIELDS,
        GOODPUT_LABELS=GOODPUT_LABELS,
        environment_rows=environment_rows,
        convention_rows=convention_rows,
        conventions_sources=conventions_sources,
        server_metrics_rows=server_metrics_rows,
        correctness_sentence=correctness_sentence,
        sessions_sentence=sessions_sentence,
        dense_sentence=dense_sentence,
        dense_rows=dense_rows,
        DENSE_COLUMNS=DENSE_COLUMNS,
        session_rows=session_rows,
        SESSION_COLUMNS=SESSION_COLUMNS,
        fairness_sentence=fairness_sentence,
        deadlines_sentence=deadlines_sentence,
        tenant_rows=tenant_rows,
        TENANT_COLUMNS=TENANT_COLUMNS,
        shedding_sentence=shedding_sentence,
        recovery_sentence=recovery_sentence,
        overload_phase_rows=phase_rows,
        little_rows=little_rows,
        PHASE_COLUMNS=PHASE_COLUMNS,
        LITTLE_COLUMNS=LITTLE_COLUMNS,
        PHASES_TITLE=PHASES_TITLE,
        LITTLE_TITLE=LITTLE_TITLE,
        LITTLE_NOTE=LITTLE_NOTE,
        rate_tables=rate_tables,
        goodput_figures=goodput_figures,
        recovery_text=recovery_text,
        BOUND_COLUMNS=BOUND_COLUMNS,
        BOUNDS_NOTE=BOUNDS_NOTE,
        BOUNDS_TITLE=BOUNDS_TITLE,
        bound_rows=bound_rows,
        cost_sentence=cost_sentence,
        energy_sentence=energy_sentence,
        REASONING_COLUMNS=REASONING_COLUMNS,
        REASONING_TITLE=REASONING_TITLE,
        reasoning_rows=reasoning_rows,
        reasoning_sentence=reasoning_sentence,
        DISAGGREGATION_COLUMNS=DISAGGREGATION_COLUMNS,
        DISAGGREGATION_TITLE=DISAGGREGATION_TITLE,
        disaggregation_rows=disaggregation_rows,
        disaggregation_sentences=disaggregation_sentences,
    )
    return env


def run_charts(card: Card) -> list[dict]:
    """The charts of one card as [{title, svg or None, empty}] in page order. An embeddings or
    rerank run generates no token: it has no TTFT, TPOT or ITL chart to leave empty."""
    s = card.series
    token_free = card.dense is not None
    items = [
        (
            f"{charts.METRIC_TITLES[m]} CDF",
            charts.latency_cdf_svg(m, {card.run_id: s.cdf_ms.get(m)}),
        )
        for m in LATENCY_METRICS
        if m == "e2e" or not token_free
    ]
    for metric in () if token_free else ("ttft", "tpot"):
        items.append(
            (
                f"{charts.METRIC_TITLES[metric]} over time",
                charts.over_time_svg(
                    metric, {card.run_id: s.over_time.get(metric)}, s.fault_windows
                ),
            )
        )
    items.append(
        (
            "Outcomes over time",
            charts.failures_over_time_svg(s.failures_over_time, s.bin_s, s.fault_windows),
        )
    )
    if card.slices and not token_free:
        items.append(("Per-slice p99 TTFT", charts.slice_bars_svg(card.slices)))
    if s.capacity:
        items.append(("Goodput versus rate", charts.capacity_svg({card.run_id: s.capacity})))
    if card.server_metrics is not None and card.server_metrics.available:
        series = card.server_metrics.series or {}
        items.append(("Server metrics over time", charts.server_metrics_svg(series)))
    return [{"title": t, "svg": svg} for t, svg in items]


def render_html(card: Card) -> str:
    """One run's card as a complete HTML document (a str)."""
    env = card_environment()
    return env.from_string(RUN_TEMPLATE).render(card=card, charts=run_charts(card))


def render_comparison_html(comparison) -> str:
    """A `reports.compare.Comparison` as a complete HTML document (a str)."""
    env = card_environment()
    cards = comparison.cards
    overlaid = [
        (
            f"{charts.METRIC_TITLES[m]} CDF",
            charts.latency_cdf_svg(m, {c.run_id: c.series.cdf_ms.get(m) for c in cards}),
        )
        for m in LATENCY_METRICS
    ]
    for metric in ("ttft", "tpot"):
        overlaid.append(
            (
                f"{charts.METRIC_TITLES[metric]} over time",
                charts.over_time_svg(
                    metric, {c.run_id: c.series.over_time.get(metric) for c in cards}, []
                ),
            )
        )
    if any(c.series.capacity for c in cards):
        overlaid.append(
            (
                "Goodput versus rate",
                charts.capacity_svg({c.run_id: c.series.capacity for c in cards}),
            )
        )
    chart_list = [{"title": t, "svg": svg} for t, svg in overlaid]
    return env.from_string(COMPARISON_TEMPLATE).render(comparison=comparison, charts=chart_list)
