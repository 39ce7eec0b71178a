"""The sweep card as a self-contained HTML page: the points table, the Pareto chart of output
tokens/s per user against total output tokens/s, and throughput and latency against load."""

from __future__ import annotations

import matplotlib

from reports.charts import CHART_RC, RUN_COLOURS, figure_svg, new_figure
from reports.html import card_environment
from reports.sweep import SweepCard
from reports.templates import PAGE_HEAD, PAGE_MACROS

KIND_LABELS = {"request_rate": "request rate (requests/s)", "concurrency": "concurrency (users)"}


def _label(point) -> str:
    unit = " rps" if point.kind == "request_rate" else " users"
    return (
        f"{point.value:g}{unit}" if isinstance(point.value, int | float) else f"{point.value}{unit}"
    )


def pareto_svg(card: SweepCard) -> str | None:
    """Output tokens/s per user (y) against total output tokens/s (x), one marker per point,
    the frontier joined by a line; None when no point has both figures."""
    drawn = [p for p in card.points
             if p.output_tokens_per_s is not None and p.output_tokens_per_s_per_user is not None]  # fmt: skip
    if not drawn:
        return None
    with matplotlib.rc_context(CHART_RC):
        fig = new_figure(6.4, 3.6)
        ax = fig.add_subplot()
        xs = [p.output_tokens_per_s for p in drawn]
        ys = [p.output_tokens_per_s_per_user for p in drawn]
        ax.scatter(xs, ys, color=RUN_COLOURS[0], zorder=3, label="load point")
        frontier = sorted((p for p in drawn if p.on_frontier), key=lambda p: p.output_tokens_per_s)
        ax.plot([p.output_tokens_per_s for p in frontier],
                [p.output_tokens_per_s_per_user for p in frontier],
                color=RUN_COLOURS[1], lw=1.5, zorder=2, label="Pareto frontier")  # fmt: skip
        for p in drawn:
            ax.annotate(_label(p), (p.output_tokens_per_s, p.output_tokens_per_s_per_user),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)  # fmt: skip
        ax.set_xlabel("total output tokens/s (ok requests)")
        ax.set_ylabel("output tokens/s per user (1000 / p50 TPOT)")
        ax.set_title("Throughput against interactivity")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, frameon=False, loc="lower left")
        return figure_svg(fig)


def load_svg(card: SweepCard) -> str | None:
    """Output tokens/s and p50/p99 TTFT against the swept load (numeric values only)."""
    drawn = [p for p in card.points if isinstance(p.value, int | float)]
    if not drawn:
        return None
    with matplotlib.rc_context(CHART_RC):
        fig = new_figure(6.4, 3.0)
        ax = fig.add_subplot()
        ax2 = ax.twinx()
        x = [p.value for p in drawn]
        ax.plot(x, [p.output_tokens_per_s for p in drawn], marker="o", color=RUN_COLOURS[0],
                label="output tokens/s")  # fmt: skip
        ax2.plot(x, [p.ttft_p50_ms for p in drawn], marker="x", ls=":", color=RUN_COLOURS[1],
                 label="p50 TTFT (ms)")  # fmt: skip
        ax2.plot(x, [p.ttft_p99_ms for p in drawn], marker="x", ls="--", color=RUN_COLOURS[2],
                 label="p99 TTFT (ms)")  # fmt: skip
        ax.set_xlabel(KIND_LABELS.get(card.kind, card.kind))
        ax.set_ylabel("output tokens/s")
        ax2.set_ylabel("TTFT (ms)")
        ax2.grid(False)
        if len(set(x)) > 2 and min(x) > 0 and max(x) / min(x) >= 8:
            ax.set_xscale("log", base=2)
        handles, labels = ax.get_legend_handles_labels()
        handles2, labels2 = ax2.get_legend_handles_labels()
        ax.legend(handles + handles2, labels + labels2, fontsize=7, frameon=False,
                  loc="upper left", bbox_to_anchor=(1.12, 1.0))  # fmt: skip
        ax.set_title("Throughput and TTFT against load")
        return figure_svg(fig)


SWEEP_TEMPLATE = (
    "{% set title = 'Sweep: ' ~ card.sweep_id %}"
    + PAGE_HEAD
    + PAGE_MACROS
    + """
<header>
<h1>Sweep: {{ card.sweep_id }}</h1>
<p class="sub">{{ card.points | length }} runs over {{ KIND_LABELS.get(card.kind, card.kind) }} ·
model {{ card.model or "—" }} · workload {{ card.workload or "—" }} · SLO {{ card.slo_name or "none" }}</p>
</header>
{% for note in card.notes %}<p class="warning">{{ note }}</p>{% endfor %}
{{ chart_grid(charts) }}
<h2>Points</h2>
<table>
<tr><th class="text">run</th><th>load</th><th>n</th><th>ok</th><th>requests/s</th><th>output tokens/s</th><th>tokens/s per user</th>
<th>p50 TTFT (ms)</th><th>p99 TTFT (ms)</th><th>p50 TPOT (ms)</th><th>p99 TPOT (ms)</th><th>p50 ITL (ms)</th><th>p99 ITL (ms)</th>
<th>p99 E2E (ms)</th><th>goodput (requests/s)</th><th>attainment</th><th>frontier</th></tr>
{% for p in card.points %}<tr><td class="text" style="white-space: nowrap"><code>{{ p.run_dir }}</code></td><td>{{ label(p) }}</td><td>{{ p.n | fmt }}</td><td>{{ p.n_ok | fmt }}</td>
<td>{{ p.request_per_s | fmt(2) }}</td><td>{{ p.output_tokens_per_s | fmt(1) }}</td><td>{{ p.output_tokens_per_s_per_user | fmt(1) }}</td>
<td>{{ p.ttft_p50_ms | fmt(1) }}</td><td>{{ p.ttft_p99_ms | fmt(1) }}</td><td>{{ p.tpot_p50_ms | fmt(2) }}</td><td>{{ p.tpot_p99_ms | fmt(2) }}</td>
<td>{{ p.itl_p50_ms | fmt(2) }}</td><td>{{ p.itl_p99_ms | fmt(2) }}</td><td>{{ p.e2e_p99_ms | fmt(1) }}</td>
<td>{{ p.goodput_request_per_s | fmt(2) }}</td><td>{{ p.attainment | fmt(3) }}</td><td>{{ "★" if p.on_frontier else "" }}</td></tr>
{% endfor %}
</table>
<p class="sub">Tokens/s per user is 1000 / p50 TPOT, the decode speed one user sees; a point is on the
Pareto frontier (★) when no other point has more output tokens/s both in total and per user. Goodput needs an SLO
(--slo on the sweep). Latencies are over ok requests.</p>
<p class="sub">Sweep card schema version {{ card.schema_version }}.</p>
</body>
</html>
"""
)


def render_sweep_html(card: SweepCard) -> str:
    """The sweep card as a complete HTML document (a str)."""
    env = card_environment()
    env.globals.update(KIND_LABELS=KIND_LABELS, label=_label)
    charts = [
        {"title": "Throughput against interactivity (Pareto)", "svg": pareto_svg(card)},
        {"title": "Throughput and TTFT against load", "svg": load_svg(card)},
    ]
    return env.from_string(SWEEP_TEMPLATE).render(card=card, charts=charts)
