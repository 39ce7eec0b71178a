"""The card's view of the run's checks: the prompt-token cross-check and tokenizer choice
(banners), the target's own metrics, and the output-correctness oracle. Figures come from
`slo` (the summary's `prompt_tokens`, `server_metrics` and `correctness` blocks)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from slo.runrecord import RunManifest


def check_notes(summary: dict, manifest: RunManifest | None) -> list[str]:
    """Banner sentences: a prompt-token disagreement (with its measured ratio), an unknown
    tokenizer, an engine that serves one request at a time, metrics that are not available."""
    notes = []
    target = (manifest.target if manifest else None) or {}
    sentence = (summary.get("prompt_tokens") or {}).get("sentence")
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


def server_metrics_rows(block: dict | None) -> list[tuple[str, str, str]]:
    """`(metric, mean or increase, max)` rows of the summary's `server_metrics` block."""
    if not block or not block.get("available"):
        return []
    gauges = block.get("gauges") or {}
    counters = block.get("counters") or {}
    rows = []
    for key, label in (("running", "running requests"), ("waiting", "waiting requests")):
        g = gauges.get(key)
        rows.append((label, _num(g and g["mean"]), _num(g and g["max"], 0)))
    kv = gauges.get("kv_cache_usage")
    rows.append(("KV cache usage", _pct(kv and kv["mean"]), _pct(kv and kv["max"])))
    rows.append(("preemptions (increase)", _num(counters.get("preemptions"), 0), ""))
    rows.append(("prefix-cache hit rate", _pct(block.get("prefix_cache_hit_rate")), ""))
    if block.get("spec_decode_acceptance") is not None:
        rows.append(("spec-decode acceptance", _pct(block["spec_decode_acceptance"]), ""))
    if block.get("spec_decode_mean_accepted_length") is not None:
        drafts = (block.get("counters") or {}).get("spec_decode_drafts")
        rows.append((
            "spec-decode tokens per verify step",
            _num(block["spec_decode_mean_accepted_length"]),
            f"{_num(drafts, 0)} drafts",
        ))  # fmt: skip
    return rows


def server_metrics_renderable(block: dict | None):
    """A rich table of the target's metrics, or the sentence saying they are not available."""
    if not block or not block.get("available"):
        reason = (block or {}).get("reason") or "not available: no server metrics were recorded"
        return Text(f"server metrics {reason}", style="dim")
    table = Table(title="server metrics (the target's /metrics)", title_justify="left")
    for name in ("metric", "mean", "max"):
        table.add_column(name, justify="left" if name == "metric" else "right")
    for row in server_metrics_rows(block):
        table.add_row(*row)
    return table


def correctness_sentence(block: dict | None) -> str | None:
    """`outputs vs reference: 30/32 exact (93.8%), agreement 0.97, 1 wrong ...`, or None."""
    if not block:
        return None
    flags = ", ".join(f"{k} {v}" for k, v in (block.get("flags") or {}).items() if v)
    parts = []
    if block.get("n_compared"):
        parts.append(
            f"outputs vs the reference engine (batch 1): {block['n_exact']}/{block['n_compared']} "
            f"exact ({_pct(block.get('exact_rate'))}), token agreement "
            f"{_num(block.get('agreement_mean'), 3)}, {block.get('n_wrong')} wrong "
            f"(diverged before token {block.get('diverge_before')})"
        )
    if flags:
        parts.append(f"flags: {flags}")
    return "; ".join(parts) or None


RATE_TABLES = (
    ("by_load", "load", "in flight at send"),
    ("by_server_batch", "batch", "server batch (running) at send"),
)


def correctness_renderable(block: dict | None):
    """The oracle's sentence and its rates by load level and by server batch (None when
    outputs were not checked)."""
    sentence = correctness_sentence(block)
    if sentence is None:
        return None
    parts = [Text(sentence)]
    for field_, key, title in RATE_TABLES:
        if not block.get(field_):
            continue
        table = Table()
        for name in (title, "n", "exact", "wrong"):
            table.add_column(name, justify="right")
        for row in block[field_]:
            table.add_row(row[key], str(row["n"]), _pct(row["exact_rate"]), _pct(row["wrong_rate"]))
        parts.append(table)
    return Group(*parts)


CHECKS_HTML = """
<h2>Server metrics</h2>
{% set sm = card.server_metrics %}
{% if sm and sm.available %}<table><tr><th>metric</th><th>mean</th><th>max</th></tr>
{% for r in server_metrics_rows(sm) %}<tr><td>{{ r[0] }}</td><td>{{ r[1] }}</td><td>{{ r[2] }}</td></tr>{% endfor %}
</table><p class="sub">{{ sm.samples }} samples of the target's /metrics.</p>
{% else %}<p class="empty">Server metrics {{ (sm or {}).get("reason") or "not available" }}.</p>{% endif %}
<h2>Output correctness</h2>
{% set c = card.correctness %}
{% if c %}<p class="sub">{{ correctness_sentence(c) }}</p>
{% for field, key, title in RATE_TABLES if c.get(field) %}<table><tr><th>{{ title }}</th><th>n</th><th>exact</th><th>wrong</th></tr>
{% for r in c[field] %}<tr><td>{{ r[key] }}</td><td>{{ r.n }}</td><td>{{ r.exact_rate | fmt(3) }}</td><td>{{ r.wrong_rate | fmt(3) }}</td></tr>{% endfor %}
</table>{% endfor %}
{% else %}<p class="empty">Outputs were not checked (bench run --check-outputs compares them with the reference engine).</p>{% endif %}
"""


def checks_renderables(server_metrics: dict | None, correctness: dict | None) -> list:
    """The console card's server-metrics and correctness parts (none for older summaries)."""
    parts = [] if server_metrics is None else [server_metrics_renderable(server_metrics)]
    oracle = correctness_renderable(correctness)
    return parts if oracle is None else [*parts, oracle]
