"""The card's "Bounds and cost" section, from the summary's `bounds` block (`slo.bounds`,
`slo.cost`): each bound as its formula, the bound, what the run measured, their ratio and why
they can differ (or why the figure is absent); then the cost per million output tokens at the
SLO and the energy per output token, as sentences.

The same rows feed the console (`bounds_renderable`) and the HTML card (`BOUNDS_HTML`)."""

from __future__ import annotations

from typing import NamedTuple

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from slo.runrecord import (
    Bounds,
    Cost,
    Distribution,
    Energy,
    KVPeakBound,
    KVRequestBound,
    LittleBounds,
    PhaseLittle,
    TransferBound,
)

BOUND_COLUMNS = ("figure", "definition", "bound", "the run measured", "ratio", "why they differ")
# The console keeps the figures in the table and gives each row's definition and reasons as a
# wrapped line below it: a terminal cannot hold a paragraph in a column.
CONSOLE_COLUMNS = ("figure", "bound", "the run measured", "ratio")
BOUNDS_TITLE = "Bounds and cost"
BOUNDS_NOTE = (
    "Lower bounds from the model's geometry are orders of magnitude, not predictions: page "
    "fragmentation, quantisation metadata, batch composition and kernels keep a real run off them."
)
NONE = "—"


class BoundRow(NamedTuple):
    """One line of the bounds table, as display text (`BOUND_COLUMNS`)."""

    figure: str
    definition: str
    bound: str
    measured: str
    ratio: str
    why: str


def _bytes(value: float | None) -> str:
    if value is None:
        return NONE
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(value) >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:,.0f} B"


def _num(value: float | None, digits: int = 3) -> str:
    return NONE if value is None else f"{value:,.{digits}f}"


def _absent(figure: str, definition: str | None, why: str | None) -> BoundRow:
    return BoundRow(figure, definition or NONE, NONE, NONE, NONE, f"absent: {why}")


def kv_request_row(kv: KVRequestBound) -> BoundRow:
    """M_KV per request: the sums over the compared requests, the per-request ratio's median
    and extremes, and what block rounding alone explains."""
    figure = "KV bytes per request (ok requests, summed)"
    if kv.absent:
        return _absent(figure, kv.formula, kv.absent)
    per = kv.ratio_per_request or Distribution.empty()
    rounding = kv.explained_ratio or Distribution.empty()
    ratio = f"{_num(kv.ratio)} (per request: p50 {_num(per.p50)}, max {_num(per.max)})"
    why = (
        f"{kv.why_differs}. Rounding and the pool's bytes per token alone: p50 "
        f"{_num(rounding.p50)}, max {_num(rounding.max)}; {kv.below_bound} of {kv.n} requests "
        f"below their bound, {kv.evicted} with tokens evicted"
    )
    bound = f"{_bytes(kv.bound_bytes)} ({kv.bytes_per_token:,} B a token)"
    return BoundRow(figure, kv.formula or NONE, bound, _bytes(kv.measured_bytes), ratio, why)


def kv_peak_row(peak: KVPeakBound) -> BoundRow:
    """M_KV of the peak in-flight set, and the engine's KV gauge at the scrape that saw the
    most tokens held against the bound at that instant."""
    figure = "KV bytes of the peak in-flight set"
    definition = f"{peak.formula}; T: {peak.approximation}"
    if peak.absent:
        return _absent(figure, definition, peak.absent)
    bound = (
        f"{_bytes(peak.bound_bytes)} ({peak.tokens_held:,} tokens, {peak.in_flight} requests, at "
        f"{_num(peak.peak_s)} s)"
    )
    measured = NONE
    if peak.measured_bytes is not None:
        bound += f"; at the scrape {_num(peak.sample_s)} s: {_bytes(peak.sample_bound_bytes)}"
        measured = (
            f"{_bytes(peak.measured_bytes)} (scrape at {_num(peak.sample_s)} s; run max "
            f"{_bytes(peak.measured_max_bytes)})"
        )
    return BoundRow(figure, definition, bound, measured, _num(peak.ratio), peak.why_differs or "")


def little_rows(little: LittleBounds) -> list[BoundRow]:
    """Little's law per load phase: lambda x W where the bounds have their bound, L measured."""
    if little.absent:
        return [_absent("Little's law", little.formula, little.absent)]
    rows = []
    for p in little.phases or []:
        law = p.little_law or PhaseLittle.empty()
        figure = f"Little's law, phase {p.phase} ({_num(p.start_s, 2)}-{_num(p.end_s, 2)} s)"
        bound = (
            f"{_num(law.predicted_in_flight, 2)} in flight (lambda {_num(law.arrival_rate_per_s, 2)}"
            f"/s x W {_num(law.mean_time_in_system_s)} s)"
        )
        measured = f"{_num(law.mean_in_flight, 2)} in flight (L; max {law.peak_in_flight})"
        why = little.why_differs or ""
        ratio = _num(law.ratio)
        w, length = law.mean_time_in_system_s, (p.end_s or 0.0) - (p.start_s or 0.0)
        if w is not None and length < w:
            ratio = NONE  # no steady state to judge: a burst, or a phase shorter than W
            why = (
                f"not judged: the phase ({_num(length, 2)} s) is shorter than the time in system "
                f"W ({_num(w)} s), so it never reached a steady state (requests sent at once)"
            )
        if law.unfinished:
            why += f"; {law.unfinished} request(s) never finished"
        rows.append(BoundRow(figure, little.formula or NONE, bound, measured, ratio, why))
    return rows


def transfer_row(transfer: TransferBound) -> BoundRow:
    """The P/D transfer bound (absent until a run records KV moves)."""
    figure = "P/D KV transfer time"
    if transfer.absent:
        return _absent(figure, transfer.formula, transfer.absent)
    return BoundRow(
        figure,
        transfer.formula or NONE,
        f"{_num(transfer.bound_s)} s",
        f"{_num(transfer.measured_s)} s",
        _num(transfer.ratio),
        transfer.why_differs or "",
    )


def bound_rows(bounds: Bounds) -> list[BoundRow]:
    """Every row of the bounds table, in card order (a block missing from the summary reads as
    absent)."""
    return [
        kv_request_row(bounds.kv_request or KVRequestBound.empty()),
        kv_peak_row(bounds.kv_peak or KVPeakBound.empty()),
        *little_rows(bounds.little_law or LittleBounds.empty()),
        transfer_row(bounds.transfer or TransferBound.empty()),
    ]


def _usd(value: float | None) -> str:
    return NONE if value is None else f"${value:,.4f}"


def cost_sentence(cost: Cost | None) -> str:
    """`Cost: $8,333.3333 per million output tokens at the SLO (120 tokens of good requests);
    $5,000.0000 per million of all 200 output tokens; the run cost $1.0000 ($10.00 an hour
    over 360.0 s).`, or why there is no figure."""
    cost = cost or Cost.empty()
    if cost.absent:
        return f"Cost: absent: {cost.absent}."
    at_slo = (
        f"absent: {cost.good_absent}"
        if cost.good_absent
        else f"{_usd(cost.usd_per_million_good_tokens)} per million output tokens at the SLO "
        f"({cost.good_output_tokens:,} tokens of good requests)"
    )
    every = (
        f"absent: {cost.all_absent}"
        if cost.all_absent
        else f"{_usd(cost.usd_per_million_output_tokens)} per million of all "
        f"{cost.all_output_tokens:,} output tokens"
    )
    return (
        f"Cost: {at_slo}; {every}; the run cost {_usd(cost.run_cost_usd)} "
        f"(${cost.cost_per_hour_usd:,.2f} an hour over {_num(cost.window_s, 1)} s)."
    )


def energy_sentence(energy: Energy | None) -> str:
    """`Energy: 400.0 J over 360.0 s (1.11 W): 2.0000 J per output token (rapl:package-0 300.0
    J, nvml:0 100.0 J); <what the counters cover>.`, or why there is no figure."""
    energy = energy or Energy.empty()
    if energy.absent:
        return f"Energy: absent: {energy.absent}."
    counters = ", ".join(f"{k} {v:,.1f} J" for k, v in (energy.joules_by_counter or {}).items())
    return (
        f"Energy: {_num(energy.joules, 1)} J over {_num(energy.duration_s, 1)} s "
        f"({_num(energy.mean_power_w, 2)} W): {_num(energy.joules_per_output_token, 4)} J per "
        f"output token ({counters}); {energy.note}."
    )


def bounds_renderable(bounds: Bounds | None):
    """The console card's bounds part, or None for a summary without the block."""
    if bounds is None:
        return None
    table = Table(
        box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False, expand=False
    )
    for name in CONSOLE_COLUMNS:
        table.add_column(name, justify="left", overflow="fold")
    rows = bound_rows(bounds)
    notes = []
    for row in rows:
        table.add_row(row.figure, row.bound, row.measured, row.ratio)
        notes.append(Text(f"- {row.figure}: {row.definition}. {row.why}", style="dim"))
    return Group(
        Text(""),
        Text(BOUNDS_TITLE, style="bold"),
        table,
        *notes,
        Text(cost_sentence(bounds.cost)),
        Text(energy_sentence(bounds.energy)),
        Text(BOUNDS_NOTE, style="dim"),
    )


BOUNDS_HTML = """
{% set b = card.bounds %}
{% if b %}<h2>{{ BOUNDS_TITLE }}</h2>
<p class="sub">{{ BOUNDS_NOTE }}</p>
<table><tr>{% for c in BOUND_COLUMNS %}<th class="text">{{ c }}</th>{% endfor %}</tr>
{% for r in bound_rows(b) %}<tr>{% for v in r %}<td class="text">{{ v }}</td>{% endfor %}</tr>{% endfor %}
</table>
<p class="sub">{{ cost_sentence(b.cost) }}</p>
<p class="sub">{{ energy_sentence(b.energy) }}</p>{% endif %}
"""
