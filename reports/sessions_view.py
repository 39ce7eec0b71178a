"""The card's view of a multi-turn run: sessions, their duration, and TTFT and prefix-cache hits
by turn index. Figures come from the summary's `sessions` block (`slo.sessions`)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from slo.runrecord import Distribution, Sessions

SESSION_COLUMNS = (
    "turn",
    "n",
    "ok",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "prompt tok",
    "cached tok",
    "cache hit",
)


def _num(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _pct(value) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def sessions_sentence(block: Sessions | None) -> str | None:
    """`4 sessions (4 complete, 3.0 turns on average, 0 turns not sent); duration p50 0.65 s,
    p90 1.03 s; prefix-cache hit rate 59.8%`, or None outside multi-turn runs."""
    if block is None:
        return None
    duration = block.duration_s or Distribution.empty()
    turns = block.turns or Distribution.empty()
    not_sent = 0 if block.turns_not_sent is None else block.turns_not_sent
    return (
        f"{block.sessions} sessions ({block.complete} complete, "
        f"{_num(turns.mean)} turns on average, "
        f"{not_sent} turns not sent); session duration p50 "
        f"{_num(duration.p50, 2)} s, p90 {_num(duration.p90, 2)} s; prefix-cache "
        f"hit rate {_pct(block.cache_hit_rate)} (usage.prompt_tokens_details.cached_tokens)"
    )


def session_rows(block: Sessions | None) -> list[tuple[str, ...]]:
    """One row per turn index, in `SESSION_COLUMNS` order."""
    rows = []
    for t in (block.by_turn if block is not None else None) or []:
        ttft = t.ttft_ms or Distribution.empty()
        rows.append(
            (
                str(t.turn),
                str(t.n),
                str(t.ok),
                _num(ttft.p50),
                _num(ttft.p90),
                _num(t.prompt_tokens_mean),
                _num(t.cached_tokens_mean),
                _pct(t.cache_hit_rate),
            )
        )
    return rows


def sessions_renderable(block: Sessions | None):
    """The console card's sessions part, or None outside multi-turn runs."""
    sentence = sessions_sentence(block)
    if sentence is None:
        return None
    table = Table(title="by turn", title_justify="left")
    for name in SESSION_COLUMNS:
        table.add_column(name, justify="right")
    for row in session_rows(block):
        table.add_row(*row)
    return Group(Text(sentence), table)


SESSIONS_HTML = """
{% set s = card.sessions %}
{% if s %}<h2>Sessions</h2>
<p class="sub">{{ sessions_sentence(s) }}</p>
<table><tr>{% for c in SESSION_COLUMNS %}<th>{{ c }}</th>{% endfor %}</tr>
{% for r in session_rows(s) %}<tr>{% for v in r %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}
</table>{% endif %}
"""
