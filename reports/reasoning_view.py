"""The card's reasoning section: for a run in which a reasoning model thought before answering,
the time to its first reasoning token and to its first answer token, the TPOT of each part and
the tokens of each, as percentiles over ok requests, and which TTFT the SLO judged. Figures
come from the summary's `reasoning` block (`slo.reasoning`), absent for a run without
reasoning, so such a run's card has no section. Console and HTML show the same rows."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from reports.distribution_table import DISTRIBUTION_COLUMNS, distribution_rows
from slo.runrecord import Reasoning

REASONING_TITLE = "Reasoning and answer (ok requests)"
REASONING_COLUMNS = DISTRIBUTION_COLUMNS
TTFT_WORDS = {
    "first_token": "the first token of either kind (reasoning or answer)",
    "first_answer_token": "the first answer token, after the reasoning",
}


def reasoning_rows(block: Reasoning) -> list[tuple[str, ...]]:
    """One row per figure: its label, n and p50, p90, p99, max."""
    figures = (
        ("TTFT to first reasoning token (ms)", block.ttft_reasoning_ms, "ms"),
        ("TTFT to first answer token (ms)", block.ttft_answer_ms, "ms"),
        ("TPOT, reasoning (ms)", block.tpot_reasoning_ms, "ms"),
        ("TPOT, answer (ms)", block.tpot_answer_ms, "ms"),
        ("reasoning tokens", block.reasoning_tokens_per_request, "tokens"),
        ("answer tokens", block.answer_tokens_per_request, "tokens"),
        ("reasoning tokens (server's usage)", block.server_reasoning_tokens_per_request, "tokens"),
    )
    return distribution_rows(figures)


def reasoning_sentence(block: Reasoning) -> str:
    """How many requests reasoned, and which TTFT the SLO judged."""
    head = f"{block.requests_with_reasoning or 0} ok request(s) had reasoning tokens."
    if block.slo_ttft is None:
        return f"{head} No SLO judged this run."
    words = TTFT_WORDS.get(block.slo_ttft, block.slo_ttft)
    return f"{head} The SLO's TTFT ({block.slo_ttft}) ends at {words}."


def reasoning_renderable(block: Reasoning | None):
    """The console card's reasoning part, or None for a run without reasoning."""
    if block is None:
        return None
    table = Table(
        box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False, expand=False
    )
    for i, name in enumerate(REASONING_COLUMNS):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in reasoning_rows(block):
        table.add_row(*row)
    return Group(
        Text(""), Text(REASONING_TITLE, style="bold"), table, Text(reasoning_sentence(block))
    )


REASONING_HTML = """
{% set rz = card.reasoning %}
{% if rz %}<h2>{{ REASONING_TITLE }}</h2>
<p class="sub">{{ reasoning_sentence(rz) }}</p>
<table><tr>{% for c in REASONING_COLUMNS %}<th>{{ c }}</th>{% endfor %}</tr>
{% for r in reasoning_rows(rz) %}<tr><td class="text">{{ r[0] }}</td>{% for v in r[1:] %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}
</table>{% endif %}
"""
