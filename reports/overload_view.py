"""The card's overload section: when the target started shedding, how much it shed and why, the
latency and requests in flight phase by phase, the recovery time after the peak, and Little's
law per phase. Figures come from the summary's `overload` block (`slo.overload`), which only
runs with load phases (staged arrivals) or shed requests have, so a plain run's card has no
such section. The console and the HTML card show the same sentences and rows."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from slo.overload import WHOLE_RUN, OverloadRecovery, PhaseKind
from slo.runrecord import Distribution, Overload, PhaseLittle

PHASE_COLUMNS = (
    "phase no.",
    "kind",
    "from s",
    "to s",
    "rate/s",
    "sent",
    "shed",
    "shed%",
    "ok",
    "TTFT p50",
    "TTFT p90",
    "E2E p90",
)
LITTLE_COLUMNS = ("phase no.", "lambda/s", "W s", "lambda*W", "L", "max N", "ratio", "never done")
KIND_WORDS = {
    PhaseKind.BASE.value: "base",
    PhaseKind.PEAK.value: "peak",
    PhaseKind.AFTER_PEAK.value: "after peak",
    PhaseKind.RUN.value: "run",
}
PHASES_TITLE = (
    "Load phases (requests by the stage that scheduled them; rate/s offered; ok latency ms)"
)
LITTLE_TITLE = "Little's law by phase"
LITTLE_NOTE = (
    "lambda: the phase's requests per second; W: their mean time in system; L: the mean number "
    "of requests in flight over the phase, whenever sent (max N: the most at once); ratio: "
    "L / (lambda*W), near 1 in a steady state"
)


def _num(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _pct(value) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _reasons(reasons: dict | None) -> str:
    return ", ".join(f'{n} × "{reason}"' for reason, n in (reasons or {}).items())


def shedding_sentence(block: Overload) -> str:
    """`Shedding started at 2.50 s (phase 1, peak): 4 of 24 requests shed (16.7%), by reason:
    3 × "<the target's message>", 1 × "rejected_429"`, or that nothing was shed."""
    if not block.n_shed:
        return f"No request was shed ({block.n_sent} sent)."
    phase = f"phase {block.first_shed_phase}"
    if block.phase_source != WHOLE_RUN:
        kinds = {p.phase: KIND_WORDS.get(p.kind, p.kind) for p in block.phases or []}
        phase += f", {kinds.get(block.first_shed_phase, '?')}"
    return (
        f"Shedding started at {_num(block.first_shed_s, 2)} s ({phase}): {block.n_shed} of "
        f"{block.n_sent} requests shed ({_pct(block.shed_share)}), by reason: "
        f"{_reasons(block.shed_reasons)}"
    )


def recovery_sentence(block: Overload) -> str:
    """The recovery time after the peak in words, or why there is none (`OverloadRecovery`)."""
    n, tol = block.recovery_window_requests, _pct(block.recovery_tolerance)
    level = (
        f"{n} consecutive requests served, their TTFT p90 within {tol} of the base phases' "
        f"{_num(block.base_ttft_p90_ms)} ms (at most {_num(block.recovery_threshold_ms)} ms)"
    )
    end = f"the peak ended ({_num(block.peak_end_s, 2)} s)"
    judged = block.recovery
    if judged == OverloadRecovery.RECOVERED.value:
        return f"Recovered {_num(block.recovery_s, 2)} s after {end}: {level}."
    if judged == OverloadRecovery.NOT_RECOVERED.value:
        return f"Not recovered within the run: after {end}, no {level}."
    if judged == OverloadRecovery.TOO_FEW_AFTER.value:
        return f"Recovery not judged: fewer than {n} requests were sent after {end}."
    if judged == OverloadRecovery.NO_BASE_LEVEL.value:
        return (
            "Recovery not judged: the base phases have no TTFT to come back to (no ok request, "
            "or the run was not streamed)."
        )
    if block.phase_source == WHOLE_RUN:
        return (
            "The run has no load phases (no staged arrivals): it is one phase, first to last send."
        )
    return "No phase was offered more than the first: no peak to recover from."


def phase_rows(block: Overload) -> list[tuple[str, ...]]:
    """One row per phase, in `PHASE_COLUMNS` order."""
    rows = []
    for p in block.phases or []:
        latency = p.latency_ms
        ttft = (latency.ttft if latency else None) or Distribution.empty()
        e2e = (latency.e2e if latency else None) or Distribution.empty()
        rows.append(
            (
                str(p.phase),
                KIND_WORDS.get(p.kind, str(p.kind)),
                _num(p.start_s, 2),
                _num(p.end_s, 2),
                _num(p.offered_rate_per_s, 2),
                str(p.n_sent),
                str(p.n_shed),
                _pct(p.shed_share),
                str(p.n_ok),
                _num(ttft.p50),
                _num(ttft.p90),
                _num(e2e.p90),
            )
        )
    return rows


def little_rows(block: Overload) -> list[tuple[str, ...]]:
    """One row per phase, in `LITTLE_COLUMNS` order."""
    rows = []
    for p in block.phases or []:
        little = p.little_law or PhaseLittle.empty()
        rows.append(
            (
                str(p.phase),
                _num(little.arrival_rate_per_s, 2),
                _num(little.mean_time_in_system_s, 3),
                _num(little.predicted_in_flight, 2),
                _num(little.mean_in_flight, 2),
                "—" if little.peak_in_flight is None else str(little.peak_in_flight),
                _num(little.ratio, 3),
                "—" if little.unfinished is None else str(little.unfinished),
            )
        )
    return rows


def _table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
        pad_edge=False,
        show_edge=False,
    )
    for name in columns:
        table.add_column(name, justify="left" if name == "kind" else "right")
    for row in rows:
        table.add_row(*row)
    return table


def overload_renderable(block: Overload | None):
    """The console card's overload part, or None for a run without phases or shedding."""
    if block is None:
        return None
    return Group(
        Text(""),
        Text("Overload", style="bold"),
        Text(shedding_sentence(block)),
        Text(recovery_sentence(block)),
        _table(PHASES_TITLE, PHASE_COLUMNS, phase_rows(block)),
        _table(LITTLE_TITLE, LITTLE_COLUMNS, little_rows(block)),
        Text(LITTLE_NOTE, style="dim"),
    )


OVERLOAD_HTML = """
{% set o = card.overload %}
{% if o %}<h2>Overload</h2>
<p class="sub">{{ shedding_sentence(o) }}</p>
<p class="sub">{{ recovery_sentence(o) }}</p>
<p class="sub">{{ PHASES_TITLE }}</p>
<table><tr>{% for c in PHASE_COLUMNS %}<th>{{ c }}</th>{% endfor %}</tr>
{% for r in overload_phase_rows(o) %}<tr>{% for v in r %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}
</table>
<h3>{{ LITTLE_TITLE }}</h3>
<p class="sub">{{ LITTLE_NOTE }}.</p>
<table><tr>{% for c in LITTLE_COLUMNS %}<th>{{ c }}</th>{% endfor %}</tr>
{% for r in little_rows(o) %}<tr>{% for v in r %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}
</table>{% endif %}
"""
