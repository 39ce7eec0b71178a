"""The card's view of the run's checks: the prompt-token cross-check and tokenizer choice
(banners), the target's own metrics, and the output-correctness oracle. Figures come from
`slo` (the summary's `prompt_tokens`, `server_metrics` and `correctness` blocks)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from slo.runrecord import Correctness, OutputFlag, RunManifest, RunSummary, ServerMetrics


def check_notes(summary: RunSummary, manifest: RunManifest | None) -> list[str]:
    """Banner sentences: a prompt-token disagreement (with its measured ratio), an unknown
    tokenizer, an engine that serves one request at a time, metrics that are not available."""
    notes = []
    target = (manifest.target if manifest else None) or {}
    sentence = summary.prompt_tokens.sentence if summary.prompt_tokens is not None else None
    if sentence:
        notes.append(sentence)
    tokenizer = target.get("tokenizer") or {}
    if tokenizer and tokenizer.get("known") is False:
        notes.append(
            f"The target's tokenizer was not known; token counts used {tokenizer.get('source')}'s."
        )
    if target.get("serialises_requests"):
        notes.append(
            f"{target.get('engine')} serves one request at a time: concurrent requests queue, "
            "so latency grows with load while throughput stays flat."
        )
    return notes


def _pct(value) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _num(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def server_metrics_rows(block: ServerMetrics | None) -> list[tuple[str, str, str]]:
    """`(metric, mean or increase, max)` rows of the summary's `server_metrics` block; the
    gauges and counters are keyed by `slo.server_metrics`' short names."""
    if block is None or not block.available:
        return []
    gauges = block.gauges or {}
    counters = block.counters or {}
    rows = []
    for key, label in (("running", "running requests"), ("waiting", "waiting requests")):
        g = gauges.get(key)
        rows.append((label, _num(g and g.mean), _num(g and g.max, 0)))
    kv = gauges.get("kv_cache_usage")
    rows.append(("KV cache usage", _pct(kv and kv.mean), _pct(kv and kv.max)))
    rows.append(("preemptions (increase)", _num(counters.get("preemptions"), 0), ""))
    rows.append(("prefix-cache hit rate", _pct(block.prefix_cache_hit_rate), ""))
    if block.spec_decode_acceptance is not None:
        rows.append(("spec-decode acceptance", _pct(block.spec_decode_acceptance), ""))
    if block.spec_decode_mean_accepted_length is not None:
        drafts = counters.get("spec_decode_drafts")
        rows.append((
            "spec-decode tokens per verify step",
            _num(block.spec_decode_mean_accepted_length),
            f"{_num(drafts, 0)} drafts",
        ))  # fmt: skip
    return rows


def server_metrics_renderable(block: ServerMetrics | None):
    """A rich table of the target's metrics, or the sentence saying they are not available."""
    if block is None or not block.available:
        reason = (block.reason if block is not None else None) or (
            "not available: no server metrics were recorded"
        )
        return Text(f"server metrics {reason}", style="dim")
    table = Table(title="server metrics (the target's /metrics)", title_justify="left")
    for name in ("metric", "mean", "max"):
        table.add_column(name, justify="left" if name == "metric" else "right")
    for row in server_metrics_rows(block):
        table.add_row(*row)
    return table


def correctness_sentence(block: Correctness | None) -> str | None:
    """`outputs vs reference: 30/32 exact (93.8%), agreement 0.97, 1 wrong ...`, or None."""
    if block is None:
        return None
    flags = ", ".join(f"{k} {v}" for k, v in (block.flags or {}).items() if v)
    parts = []
    if block.n_compared:
        parts.append(
            f"outputs vs the reference engine (batch 1): {block.n_exact}/{block.n_compared} "
            f"exact ({_pct(block.exact_rate)}), token agreement "
            f"{_num(block.agreement_mean, 3)}, {block.n_wrong} wrong "
            f"(diverged before token {block.diverge_before})"
        )
    if block.tool_answers_checked:
        invalid = (block.flags or {}).get(OutputFlag.TOOL_CALL_INVALID.value, 0)
        parts.append(
            f"tool calls checked in {block.tool_answers_checked} answers: "
            f"{block.tool_calls_made} calls, "
            f"{invalid} answers with an invalid call"
        )
    if flags:
        parts.append(f"flags: {flags}")
    return "; ".join(parts) or None


def rate_tables(block: Correctness) -> list[tuple[str, list]]:
    """`(title, rows)` of the oracle's rates by load level, then by server batch, each only
    when it has rows; a row's `bucket` is its load or batch label."""
    tables = (
        ("in flight at send", block.by_load),
        ("server batch (running) at send", block.by_server_batch),
    )
    return [(title, rows) for title, rows in tables if rows]


def correctness_renderable(block: Correctness | None):
    """The oracle's sentence and its rates by load level and by server batch (None when
    outputs were not checked)."""
    sentence = correctness_sentence(block)
    if sentence is None:
        return None
    parts = [Text(sentence)]
    for title, rows in rate_tables(block):
        table = Table()
        for name in (title, "n", "exact", "wrong"):
            table.add_column(name, justify="right")
        for row in rows:
            table.add_row(row.bucket, str(row.n), _pct(row.exact_rate), _pct(row.wrong_rate))
        parts.append(table)
    return Group(*parts)


CHECKS_HTML = """
<h2>Server metrics</h2>
{% set sm = card.server_metrics %}
{% if sm and sm.available %}<table><tr><th>metric</th><th>mean</th><th>max</th></tr>
{% for r in server_metrics_rows(sm) %}<tr><td>{{ r[0] }}</td><td>{{ r[1] }}</td><td>{{ r[2] }}</td></tr>{% endfor %}
</table><p class="sub">{{ sm.samples }} samples of the target's /metrics.</p>
{% else %}<p class="empty">Server metrics {{ (sm.reason if sm else none) or "not available" }}.</p>{% endif %}
<h2>Output correctness</h2>
{% set c = card.correctness %}
{% if c %}<p class="sub">{{ correctness_sentence(c) }}</p>
{% for title, rows in rate_tables(c) %}<table><tr><th>{{ title }}</th><th>n</th><th>exact</th><th>wrong</th></tr>
{% for r in rows %}<tr><td>{{ r.bucket }}</td><td>{{ r.n }}</td><td>{{ r.exact_rate | fmt(3) }}</td><td>{{ r.wrong_rate | fmt(3) }}</td></tr>{% endfor %}
</table>{% endfor %}
{% else %}<p class="empty">Outputs were not checked (bench run --check-outputs compares them with the reference engine).</p>{% endif %}
"""


def checks_renderables(
    server_metrics: ServerMetrics | None, correctness: Correctness | None
) -> list:
    """The console card's server-metrics and correctness parts (none for older summaries)."""
    parts = [] if server_metrics is None else [server_metrics_renderable(server_metrics)]
    oracle = correctness_renderable(correctness)
    return parts if oracle is None else [*parts, oracle]
