"""The card's view of an embeddings or rerank run: batch sizes, texts and input tokens a second
and request latency, from the summary's `dense` block (`slo.dense`).

Such a run generates no tokens, so the card leaves out its TTFT, TPOT and ITL rows and its
output-token rates (`card_rows` below) rather than print empty rows that read as zeros; one
sentence says why they are absent (`undefined_sentence`).
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from slo.runrecord import Dense, Distribution

DENSE_COLUMNS = ("figure", "mean", "p50", "p90", "p99", "max")
# Throughput rows that mean nothing when no token is generated.
OUTPUT_RATES = ("output_tokens_per_s", "total_tokens_per_s")
SOURCE_WORDS = {
    "usage": "the server's usage.prompt_tokens",
    "workload": "the run's tokenizer on the texts sent (an answer lacked usage)",
}


def _num(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def dense_sentence(block: Dense | None) -> str | None:
    """`embeddings: 20.0 requests/s, 80.0 texts/s, 1,281 input tokens/s (counted by ...)`,
    or None outside embeddings and rerank runs."""
    if block is None:
        return None
    source = SOURCE_WORDS.get(block.input_tokens_source, block.input_tokens_source or "—")
    return (
        f"{block.api}: {_num(block.request_per_s)} requests/s, {_num(block.texts_per_s)} "
        f"texts/s, {_num(block.input_tokens_per_s, 0)} input tokens/s (ok requests; input tokens "
        f"counted by {source})"
    )


def dense_rows(block: Dense | None) -> list[tuple[str, ...]]:
    """Batch size, input tokens and latency per ok request, in `DENSE_COLUMNS` order."""
    if block is None:
        return []
    rows = []
    for label, dist, digits in (
        ("texts per request (batch size)", block.texts_per_request, 1),
        ("input tokens per request", block.input_tokens, 1),
        ("request latency (ms)", block.latency_ms, 1),
    ):
        d = dist or Distribution.empty()
        rows.append((label, *(_num(v, digits) for v in (d.mean, d.p50, d.p90, d.p99, d.max))))
    return rows


def undefined_sentence(undefined_metrics: dict, metrics: tuple[str, ...]) -> str | None:
    """`TTFT, TPOT, ITL: undefined: ...` for the card's latency metrics that have no value
    (one sentence when they share their reason), or None when all are defined."""
    by_reason: dict[str, list[str]] = {}
    for metric in metrics:
        if metric in undefined_metrics:
            by_reason.setdefault(undefined_metrics[metric], []).append(metric.upper())
    if not by_reason:
        return None
    return " ".join(f"{', '.join(names)}: {why}." for why, names in by_reason.items())


def dense_renderable(block: Dense | None):
    """The console card's dense part, or None outside embeddings and rerank runs."""
    sentence = dense_sentence(block)
    if sentence is None:
        return None
    table = Table(title="Embeddings and rerank (ok requests)", title_justify="left")
    for name in DENSE_COLUMNS:
        table.add_column(name, justify="left" if name == "figure" else "right")
    for row in dense_rows(block):
        table.add_row(*row)
    return Group(Text(sentence), table)


DENSE_HTML = """
{% set d = card.dense %}
{% if d %}<h2>Embeddings and rerank</h2>
<p class="sub">{{ dense_sentence(d) }}</p>
<table><tr>{% for c in DENSE_COLUMNS %}<th>{{ c }}</th>{% endfor %}</tr>
{% for r in dense_rows(d) %}<tr>{% for v in r %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}
</table>{% endif %}
"""
