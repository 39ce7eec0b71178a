"""The card's view of request classes: how fairly the tenants were served (Jain's index over
goodput against max-min fair shares, per tenant) and how many deadlines were missed. Figures
come from the summary's `fairness` and `deadlines` blocks (`slo.classes`); the slices by
tenant and by priority are in the card's slices table with the others."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from slo.runrecord import Deadlines, Fairness

TENANT_COLUMNS = ("tenant", "sent req/s", "goodput req/s", "fair share req/s", "goodput / share")


def _num(value, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def fairness_sentence(block: Fairness | None) -> str | None:
    """`Jain's fairness index 0.98 over 2 tenants (goodput / max-min fair share; 0.61 over
    raw goodput)`, or None when the requests had no tenants."""
    if block is None:
        return None
    tenants = block.tenants or []
    return (
        f"Jain's fairness index {_num(block.jain_index)} over {len(tenants)} tenants "
        f"(goodput / max-min fair share of the run's goodput; {_num(block.raw_jain_index)} "
        "over raw goodput)"
    )


def tenant_rows(block: Fairness | None) -> list[tuple[str, ...]]:
    """One row per tenant, in `TENANT_COLUMNS` order."""
    return [
        (
            str(t.tenant),
            _num(t.sent_request_per_s),
            _num(t.goodput_request_per_s),
            _num(t.fair_share_request_per_s),
            _num(t.normalised_goodput),
        )
        for t in (block.tenants if block is not None else None) or []
    ]


def deadlines_sentence(block: Deadlines | None) -> str | None:
    """`deadlines: 40 of 50 met, miss rate 20.0% (6 late, 2 dropped by the server, 2 rejected
    at admission, 0 failed otherwise)`, or None when no request had a deadline."""
    if block is None or not block.with_deadline:
        return None
    rate = "—" if block.miss_rate is None else f"{100 * block.miss_rate:.1f}%"
    return (
        f"deadlines: {block.met_deadline} of {block.with_deadline} met, miss rate {rate} "
        f"({block.finished_late} late, {block.dropped_by_server} dropped by the server, "
        f"{block.rejected_at_admission} rejected at admission, {block.failed_otherwise} "
        "failed otherwise)"
    )


def classes_renderable(fairness: Fairness | None, deadlines: Deadlines | None):
    """The console card's part on tenants and deadlines, or None when neither applies."""
    parts = []
    sentence = fairness_sentence(fairness)
    if sentence is not None:
        table = Table(title="by tenant", title_justify="left")
        for name in TENANT_COLUMNS:
            table.add_column(name, justify="right")
        for row in tenant_rows(fairness):
            table.add_row(*row)
        parts += [Text(sentence), table]
    sentence = deadlines_sentence(deadlines)
    if sentence is not None:
        parts.append(Text(sentence))
    return Group(*parts) if parts else None


CLASSES_HTML = """
{% if card.fairness or (card.deadlines and card.deadlines.with_deadline) %}<h2>Tenants and deadlines</h2>
{% if card.fairness %}<p class="sub">{{ fairness_sentence(card.fairness) }}</p>
<table><tr>{% for c in TENANT_COLUMNS %}<th>{{ c }}</th>{% endfor %}</tr>
{% for r in tenant_rows(card.fairness) %}<tr>{% for v in r %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}
</table>{% endif %}
{% if deadlines_sentence(card.deadlines) %}<p>{{ deadlines_sentence(card.deadlines) }}</p>{% endif %}
{% endif %}
"""
