"""Jinja2 templates of the HTML cards (kept as strings so they ship inside the package).

The Content-Security-Policy forbids every fetch: the page is complete as written.
"""

from __future__ import annotations

from reports.bounds_view import BOUNDS_HTML
from reports.checks_view import CHECKS_HTML
from reports.classes_view import CLASSES_HTML
from reports.dense_view import DENSE_HTML
from reports.disaggregation_view import DISAGGREGATION_HTML
from reports.overload_view import OVERLOAD_HTML
from reports.reasoning_view import REASONING_HTML
from reports.sessions_view import SESSIONS_HTML

# Every card page starts with these: the head (the `title` the page sets, the inline CSS) and
# the macros its body calls.
PAGE_HEAD = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<title>{{ title }}</title>
<style>{{ css | safe }}</style>
</head>
<body>
"""

PAGE_MACROS = """
{% macro chart_grid(charts) %}
<div class="charts">
{% for chart in charts %}
<figure class="chart" data-chart="{{ chart.title }}">
{% if chart.svg %}{{ chart.svg | safe }}{% else %}<p class="empty">{{ chart.title }}: no data to draw.</p>{% endif %}
<figcaption>{{ chart.title }}</figcaption>
</figure>
{% endfor %}
</div>
{% endmacro %}

{% macro env_table(cards) %}
<table>
<tr><th class="text">field</th>{% for c in cards %}<th class="text">{{ c.run_id }}</th>{% endfor %}</tr>
{% for label in ENV_FIELDS %}
<tr><td>{{ label }}</td>{% for c in cards %}<td class="text"><code>{{ environment_rows(c.environment)[label] }}</code></td>{% endfor %}</tr>
{% endfor %}
</table>
{% endmacro %}
"""

RUN_TEMPLATE = (
    "{% set title = 'Report card: ' ~ card.run_id %}"
    + PAGE_HEAD
    + PAGE_MACROS
    + """
<header>
<h1>Report card: {{ card.run_id }} <span class="badge {{ card.headline }}">{{ card.headline | replace("_", " ") }}</span></h1>
<p class="sub">{{ card.environment.engine_line() }} ·
{{ card.environment.model or "unknown model" }} · workload {{ card.environment.workload_name or "—" }} ·
SLO {{ card.slo_name or "none" }} · window {{ card.window_s | fmt(1) }} s · started {{ card.environment.started_at or "—" }}</p>
</header>
{% for note in card.notes %}<p class="warning">{{ note }}</p>{% endfor %}

<div class="kpis">
<div class="kpi"><div class="k">goodput (requests/s)</div><div class="v">{{ (card.goodput.request_per_s if card.goodput else none) | fmt }}</div></div>
{% for t in card.throughput if t.name in ("request_per_s", "output_tokens_per_s") %}
<div class="kpi"><div class="k">{{ t.label }}</div><div class="v">{{ t.value | fmt }}</div></div>
{% endfor %}
{% for m in (("ttft", "tpot") if card.latency_row("ttft") else ("e2e",)) %}{% set row = card.latency_row(m) %}
<div class="kpi"><div class="k">p99 {{ m | upper }} (ms)</div><div class="v">{{ row.p99_ms | fmt(1) }}</div></div>
{% endfor %}
<div class="kpi"><div class="k">failed requests</div><div class="v">{{ card.failures.failed | fmt }} / {{ card.failures.total | fmt }}</div></div>
</div>

<h2>SLO {{ card.slo_name or "" }}</h2>
{% if card.slo_verdicts %}
<table>
<tr><th>objective</th><th>observed</th><th>interval</th><th>threshold</th><th>n</th><th>verdict</th><th class="text">why</th></tr>
{% for v in card.slo_verdicts %}{% set ms = v.unit == "ms" %}{% set k = 1 if ms else 100 %}{% set u = " ms" if ms else "%" %}
<tr><td>{{ v.objective }}</td><td>{{ (v.observed * k if v.observed is not none else none) | fmt(1 if ms else 2) }}{{ u if v.observed is not none }}</td>
<td class="ci">{{ [v.ci_low * k if v.ci_low is not none else none, v.ci_high * k if v.ci_high is not none else none] | fmt_ci(1 if ms else 2) }}</td>
<td>{{ (v.threshold * k if v.threshold is not none else none) | fmt(1 if ms else 2) }}{{ u if v.threshold is not none }}</td><td>{{ v.n | fmt }}</td>
<td><span class="badge {{ v.verdict }}">{{ v.verdict }}</span></td><td class="text">{{ v.reason or "" }}</td></tr>
{% endfor %}
</table>
{% else %}<p class="empty">{% if card.slo_name %}The summary has no verdicts for this SLO.{% else %}No SLO was given for this run.{% endif %}</p>{% endif %}
{% set goodput = goodput_figures(card.goodput) %}{% if goodput %}
<table><tr><th>goodput</th><th>value</th></tr>
{% for key, label in GOODPUT_LABELS if key in goodput %}<tr><td>{{ label }}</td><td>{{ goodput[key] | fmt(3) }}</td></tr>{% endfor %}
</table>
{% endif %}

<h2>Throughput</h2>
<table><tr><th>rate</th><th>value</th></tr>
{% for t in card.throughput %}<tr><td>{{ t.label }}</td><td>{{ t.value | fmt }}</td></tr>{% endfor %}
</table>
<p class="sub">Output tokens counted by: {{ card.output_tokens_source or "—" }}.</p>

<h2>Latency (ms, ok requests; 95% bootstrap intervals)</h2>
<table>
<tr><th>metric</th><th>n</th><th>mean</th><th>p50</th><th>p90</th><th>p95</th><th>p99</th><th>max</th></tr>
{% for row in card.latency %}
<tr><td>{{ METRIC_TITLES[row.metric] }} ({{ row.metric }})</td><td>{{ row.n | fmt }}</td><td>{{ row.mean_ms | fmt(1) }}</td>
<td>{{ row.p50_ms | fmt(1) }} <span class="ci">{{ row.p50_ci_ms | fmt_ci }}</span></td>
<td>{{ row.p90_ms | fmt(1) }}</td><td>{{ row.p95_ms | fmt(1) }}</td>
<td>{{ row.p99_ms | fmt(1) }} <span class="ci">{{ row.p99_ci_ms | fmt_ci }}</span></td><td>{{ row.max_ms | fmt(1) }}</td></tr>
{% endfor %}
</table>

{% if card.chunking_sentence() %}<p class="sub">{{ card.chunking_sentence() }}</p>{% endif %}
{% for name, why in card.undefined_metrics.items() if name in LATENCY_METRICS %}<p class="sub">{{ name | upper }}: {{ why }}.</p>{% endfor %}

<h2>Conventions side by side</h2>
{% set crow = convention_rows(card.conventions) %}
{% if crow %}
<table><tr><th>tool</th><th>metric</th><th>unit</th><th>mean</th><th>p50</th><th>p99</th><th>n</th><th class="text">definition</th></tr>
{% for r in crow %}<tr><td>{{ r.tool }}</td><td><code>{{ r.metric }}</code></td><td>{{ r.unit }}</td><td>{{ r.mean | fmt(2) }}</td><td>{{ r.p50 | fmt(2) }}</td><td>{{ r.p99 | fmt(2) }}</td><td>{{ r.n | fmt }}</td><td class="text">{{ r.definition }}</td></tr>{% endfor %}
</table>
<p class="sub">Sources: {% for tool, source, method in conventions_sources(card.conventions) %}{{ tool }}: {{ source }} (percentiles: {{ method }}){{ "; " if not loop.last }}{% endfor %}.</p>
{% else %}<p class="empty">{{ (card.conventions.undefined if card.conventions else none) or "No conventions in the summary." }}</p>{% endif %}

<h2>Charts</h2>
{{ chart_grid(charts) }}

<h2>Slices</h2>
{% if card.slices %}
<table><tr><th>slice</th><th>n</th><th>ok</th><th>p50 TTFT</th><th>p99 TTFT</th><th>p50 TPOT</th><th>p99 TPOT</th><th>p99 E2E</th><th>attainment</th></tr>
{% for s in card.slices %}<tr><td>{{ s.dimension }} = {{ s.value }}</td><td>{{ s.n | fmt }}</td><td>{{ s.n_ok | fmt }}</td>
<td>{{ s.ttft_p50_ms | fmt(1) }}</td><td>{{ s.ttft_p99_ms | fmt(1) }}</td><td>{{ s.tpot_p50_ms | fmt(1) }}</td>
<td>{{ s.tpot_p99_ms | fmt(1) }}</td><td>{{ s.e2e_p99_ms | fmt(1) }}</td><td>{{ s.attainment | fmt(3) }}</td></tr>{% endfor %}
</table>
{% else %}<p class="empty">No slices in the summary.</p>{% endif %}

<h2>Failures</h2>
<table><tr><th>outcome</th><th>requests</th><th>share</th></tr>
{% for kind in OUTCOME_KINDS %}{% set n = card.failures[kind] %}
<tr><td>{{ kind | replace("_", " ") }}</td><td>{{ n | fmt }}</td><td>{{ (100.0 * n / card.failures.total) | fmt(1) if card.failures.total else "—" }}%</td></tr>
{% endfor %}
</table>
{% if card.failures.by_error_class %}<p class="sub">By error class: {% for k, v in card.failures.by_error_class.items() %}{{ k }} {{ v }}{{ ", " if not loop.last }}{% endfor %}.</p>{% endif %}
{% if card.failures.first_message_by_error_class %}<table><tr><th>error class</th><th>first message</th></tr>
{% for k, v in card.failures.first_message_by_error_class.items() %}<tr><td>{{ k }}</td><td>{{ v }}</td></tr>{% endfor %}
</table>{% endif %}

"""
    + CHECKS_HTML
    + DENSE_HTML
    + SESSIONS_HTML
    + REASONING_HTML
    + DISAGGREGATION_HTML
    + OVERLOAD_HTML
    + CLASSES_HTML
    + BOUNDS_HTML
    + """
<h2>Reliability</h2>
{% if card.ledger %}<p class="{{ 'warning' if card.ledger.verdict == 'failed' else 'sub' }}">Ledger {{ card.ledger.verdict }}: {{ card.ledger.scheduled }} scheduled, lost = {{ card.ledger.lost }}, unexpected = {{ card.ledger.unexpected }}, leaked = {{ card.ledger.leaked }}{% if card.ledger.leak and card.ledger.leak.reasons %} ({{ card.ledger.leak.reasons | join("; ") }}){% elif card.ledger.leak and not card.ledger.leak.checked %} (the target has no /metrics to check for leaks){% endif %}.</p>{% else %}<p class="empty">No ledger in the summary.</p>{% endif %}
{% if card.faults %}<table><tr><th>fault</th><th>from s</th><th>to s</th><th>goodput before /s</th><th>during /s</th><th>recovered after s</th><th>ok in window</th><th>outcomes in window</th></tr>
{% for w in card.faults %}<tr><td>{{ w.kind }}</td><td>{{ w.start_s | fmt(2) }}</td><td>{{ w.end_s | fmt(2) }}</td><td>{{ w.goodput_before_per_s | fmt(2) }}</td><td>{{ w.goodput_during_per_s | fmt(2) }}</td><td>{{ recovery_text(w) }}</td><td>{{ w.attainment_in_window | fmt(3) }}</td><td>{% for k, v in w.outcomes_in_window.items() %}{{ k }} {{ v }}{{ ", " if not loop.last }}{% endfor %}</td></tr>{% endfor %}
</table>{% else %}<p class="sub">No faults were injected.</p>{% endif %}

<h2>Memory per request</h2>
{% if card.memory.available %}<p class="sub">Source: {{ card.memory.source }}.</p>
<table><tr><th>figure</th><th>n</th><th>p50</th><th>p99</th><th>max</th></tr>
{% for r in card.memory.rows %}<tr><td>{{ r.label }}</td><td>{{ r.n | fmt }}</td>{% for k in ("p50", "p99", "max") %}<td>{{ (r[k] | fmt(3)) if r.unit == "share" else (r[k] | fmt_bytes) }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% if card.memory.note %}<p class="sub">{{ card.memory.note }}</p>{% endif %}
{% else %}<p class="empty">Not available: {{ card.memory.reason }}.</p>{% endif %}

<h2>Client health</h2>
<table><tr><th>client queueing, scheduled to sent: p50 (ms)</th><th>p99 (ms)</th><th>max (ms)</th><th>client bound</th></tr>
<tr><td>{{ card.client_health.dispatch_lag_p50_ms | fmt(3) }}</td><td>{{ card.client_health.dispatch_lag_p99_ms | fmt(3) }}</td>
<td>{{ card.client_health.dispatch_lag_max_ms | fmt(3) }}</td><td>{{ card.client_health.client_bound | fmt }}</td></tr></table>
{% if card.client_health.workers %}
<table><tr><th>worker</th><th>node</th><th>requests</th><th>queueing p50 (ms)</th><th>p99 (ms)</th><th>max (ms)</th><th>clock offset (ms)</th><th>+/- (ms)</th><th>died</th></tr>
{% for w in card.client_health.workers %}<tr><td>{{ w.worker }}</td><td><code>{{ (w.node or "this host")[:12] }}</code></td><td>{{ w.requests | fmt }}</td>
<td>{{ w.dispatch_lag_p50_ms | fmt(3) }}</td><td>{{ w.dispatch_lag_p99_ms | fmt(3) }}</td><td>{{ w.dispatch_lag_max_ms | fmt(3) }}</td>
<td>{{ w.clock_offset_ms | fmt(3) }}</td><td>{{ w.clock_uncertainty_ms | fmt(3) }}</td><td>{{ w.died | fmt }}</td></tr>
{% endfor %}</table>
<p class="sub">Clock: {{ card.client_health.workers_clock }}.</p>
{% endif %}

<h2>Environment</h2>
{{ env_table([card]) }}
<p class="sub">Card schema version {{ card.schema_version }}.</p>
</body>
</html>
"""
)

COMPARISON_TEMPLATE = (
    "{% set title = 'Comparison: ' ~ (comparison.cards | map(attribute='run_id') | join(' vs ')) %}"
    + PAGE_HEAD
    + PAGE_MACROS
    + """
<header>
<h1>Comparison of {{ comparison.cards | length }} runs</h1>
<p class="sub">SLO {{ comparison.cards[0].slo_name or "none" }} · workload {{ comparison.cards[0].environment.workload_name or "—" }}.
The best value in each row is marked ★.</p>
</header>
{% for sentence in comparison.mismatches %}<p class="warning"><strong>Mismatch allowed (--allow-mismatch):</strong> {{ sentence }}</p>{% endfor %}

<h2>Side by side</h2>
<table>
<tr><th>metric</th>{% for c in comparison.cards %}<th>{{ c.run_id }}</th>{% endfor %}</tr>
<tr><td>verdict</td>{% for c in comparison.cards %}<td><span class="badge {{ c.headline }}">{{ c.headline | replace("_", " ") }}</span></td>{% endfor %}</tr>
<tr><td>engine</td>{% for c in comparison.cards %}<td>{{ c.environment.engine_line() if c.environment.engine else "—" }}</td>{% endfor %}</tr>
{% for row in comparison.rows %}
<tr><td>{{ row.label }}</td>{% for v in row.values %}<td class="{{ 'best' if loop.index0 in row.best else '' }}">{{ v | fmt(row.digits) }}</td>{% endfor %}</tr>
{% endfor %}
</table>

<h2>Overlaid charts</h2>
{{ chart_grid(charts) }}

<h2>Environment</h2>
{{ env_table(comparison.cards) }}
</body>
</html>
"""
)
