"""The card's cluster section: for a run against a prefill/decode cluster, how the KV handoffs
went (succeeded, failed, retried), the prefill, transfer and install times and the bytes per
handoff as percentiles, the link's effective bandwidth with its formula and the sums it
divides, and the requests each worker served. Figures come from the summary's
`disaggregation` block (`slo.disaggregation`), absent for a run whose target said none of
them (a single server), so such a run's card has no section. Console and HTML show the same
rows and sentences."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from reports.distribution_table import DISTRIBUTION_COLUMNS, distribution_rows
from slo.runrecord import Disaggregation

DISAGGREGATION_TITLE = "Cluster: KV handoffs and serving workers"
DISAGGREGATION_COLUMNS = DISTRIBUTION_COLUMNS


def disaggregation_rows(block: Disaggregation) -> list[tuple[str, ...]]:
    """One row per figure some request reported: its label, n and p50, p90, p99, max."""
    figures = (
        ("prefill time (ms)", block.prefill_time_ms, "ms"),
        ("KV transfer time (ms)", block.transfer_time_ms, "ms"),
        ("KV install time (ms)", block.install_time_ms, "ms"),
        ("KV bytes per handoff", block.transfer_bytes_per_request, "bytes"),
    )
    return distribution_rows(figures)


def handoffs_sentence(block: Disaggregation) -> str:
    """How many requests handed their KV over, and how those handoffs ended."""
    n = block.requests_with_transfer or 0
    if not n:
        return "No request reported a KV handoff."
    return (
        f"{n} request(s) handed their KV from a prefill to a decode worker: "
        f"{block.transfers_ok or 0} ok, {block.transfers_failed or 0} failed, "
        f"{block.transfers_retried or 0} retried."
    )


def bandwidth_sentence(block: Disaggregation) -> str | None:
    """The effective link bandwidth with its formula and the sums it divides; None without
    a handoff."""
    if not block.requests_with_transfer:
        return None
    sums = (
        f"{block.total_transfer_bytes or 0:,} bytes / {block.total_transfer_ms or 0.0:,.3f} ms "
        f"over {block.bandwidth_transfers or 0} handoff(s)"
    )
    if block.effective_bandwidth_mb_per_s is None:
        return f"Effective link bandwidth: undefined ({sums}: no time to divide by)."
    return (
        f"Effective link bandwidth: {block.effective_bandwidth_mb_per_s:,.3f} MB/s "
        f"({block.bandwidth_formula}; {sums})."
    )


def workers_sentence(block: Disaggregation) -> str | None:
    """Requests per serving worker; None when no answer named its worker."""
    if not block.requests_by_worker:
        return None
    counts = ", ".join(f"{name} {n}" for name, n in block.requests_by_worker.items())
    return f"Requests per serving worker: {counts}."


def disaggregation_sentences(block: Disaggregation) -> list[str]:
    """The section's sentences, in order."""
    said = (handoffs_sentence(block), bandwidth_sentence(block), workers_sentence(block))
    return [s for s in said if s is not None]


def disaggregation_renderable(block: Disaggregation | None):
    """The console card's cluster part, or None for a run whose target said nothing of it."""
    if block is None:
        return None
    parts = [Text(""), Text(DISAGGREGATION_TITLE, style="bold")]
    rows = disaggregation_rows(block)
    if rows:
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False)
        for i, name in enumerate(DISAGGREGATION_COLUMNS):
            table.add_column(name, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        parts.append(table)
    parts += [Text(s) for s in disaggregation_sentences(block)]
    return Group(*parts)


DISAGGREGATION_HTML = """
{% set dg = card.disaggregation %}
{% if dg %}<h2>{{ DISAGGREGATION_TITLE }}</h2>
{% for s in disaggregation_sentences(dg) %}<p class="sub">{{ s }}</p>
{% endfor %}{% set dg_rows = disaggregation_rows(dg) %}{% if dg_rows %}
<table><tr>{% for c in DISAGGREGATION_COLUMNS %}<th>{{ c }}</th>{% endfor %}</tr>
{% for r in dg_rows %}<tr><td class="text">{{ r[0] }}</td>{% for v in r[1:] %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}
</table>{% endif %}{% endif %}
"""
