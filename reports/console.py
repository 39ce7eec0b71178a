"""The card in the terminal (rich renderables), and the gate result.

`card_renderable(card)` and `gate_renderable(result)` return rich renderables (tested against
golden strings); `render_summary(card_or_summary, console)` prints the end-of-run summary that
`bench run` shows, from a Card or straight from a run's summary (`slo.summarize`'s dict, or
its typed `RunSummary`).
"""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from reports import slo_view
from reports.bounds_view import bounds_renderable
from reports.build import as_summary, build_card, latency_rows_from_summary, throughput_rows
from reports.card import LATENCY_METRICS, Card, LatencyRow, SLOVerdict, Throughput
from reports.checks_view import checks_renderables
from reports.classes_view import classes_renderable
from reports.dense_view import dense_renderable, undefined_sentence
from reports.disaggregation_view import disaggregation_renderable
from reports.errors import ReportError
from reports.faults_view import recovery_text
from reports.memory_view import memory_renderable
from reports.overload_view import overload_renderable
from reports.reasoning_view import reasoning_renderable
from reports.sessions_view import sessions_renderable
from reports.taxonomy import OUTCOME_KINDS
from slo.runrecord import FaultWindow, Goodput, LeakCheck, Ledger, RunSummary


def _spaced(parts: list[RenderableType]) -> Group:
    """The parts one under another, a blank line before each table."""
    out: list[RenderableType] = []
    for part in parts:
        if isinstance(part, Table):
            out.append(Text(""))
        out.append(part)
    return Group(*out)


def _table(title: str | None = None) -> Table:
    """A compact table: a rule under the header, one space between columns, no edges, so
    the card fits an 80-column terminal."""
    return Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
        pad_edge=False,
        show_edge=False,
    )


VERDICT_STYLES = {
    "pass": "bold green",
    "fail": "bold red",
    "inconclusive": "bold yellow",
    "no_slo": "dim",
    "regressed": "bold red",
    "improved": "bold green",
}


def _num(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def _ci(low, high, digits: int = 1) -> str:
    return "" if low is None or high is None else f" [{low:,.{digits}f}, {high:,.{digits}f}]"


def verdict_text(verdict: str) -> Text:
    """The verdict word, upper case, in its colour."""
    return Text(verdict.replace("_", " ").upper(), style=VERDICT_STYLES.get(verdict, ""))


def slo_table(verdicts: list[SLOVerdict], slo_name: str | None) -> Table:
    """One row per SLO objective: observed value with its interval, threshold, verdict."""
    table = _table(f"SLO {slo_name or ''}".strip())
    for name, justify in (("objective", "left"), ("observed", "right"), ("threshold", "right"),
                          ("n", "right"), ("verdict", "left"), ("why", "left")):  # fmt: skip
        table.add_column(name, justify=justify)
    for v in verdicts:
        observed, low, high, threshold = v.observed, v.ci_low, v.ci_high, v.threshold
        if v.unit == "ms":
            digits, unit = 1, " ms"
        else:  # fractions read as percentages
            digits, unit = 2, "%"
            observed, low, high, threshold = (
                None if x is None else 100 * x for x in (observed, low, high, threshold)
            )
        table.add_row(
            v.objective,
            _num(observed, digits) + ("" if observed is None else unit) + _ci(low, high, digits),
            _num(threshold, digits) + ("" if threshold is None else unit),
            _num(v.n),
            verdict_text(v.verdict),
            v.reason or "",
        )
    return table


def throughput_table(rates: list[Throughput], goodput: Goodput | None) -> Table:
    """Labelled throughputs, goodput first when there is one."""
    table = _table("Throughput")
    table.add_column("rate")
    table.add_column("value", justify="right")
    if goodput is not None:
        table.add_row("goodput (requests/s)", _num(goodput.request_per_s))
        table.add_row("SLO attainment", _num(goodput.attainment, 4))
    for t in rates:
        table.add_row(t.label, _num(t.value))
    return table


def latency_table(rows: list[LatencyRow]) -> Table:
    """Latency distributions (ms) with the p50 and p99 intervals where present."""
    table = _table("Latency (ms, ok requests; 95% intervals)")
    for name in ("metric", "n", "mean", "p50", "p90", "p99", "max"):
        table.add_column(name, justify="left" if name == "metric" else "right")
    for r in rows:
        p50_ci = r.p50_ci_ms or [None, None]
        p99_ci = r.p99_ci_ms or [None, None]
        table.add_row(
            r.metric.upper(),
            _num(r.n),
            _num(r.mean_ms, 1),
            _num(r.p50_ms, 1) + _ci(*p50_ci),
            _num(r.p90_ms, 1),
            _num(r.p99_ms, 1) + _ci(*p99_ci),
            _num(r.max_ms, 1),
        )
    return table


def outcomes_table(counts: dict[str, int], total: int) -> Table:
    """Requests per outcome kind with their share of all requests."""
    table = _table("Outcomes")
    table.add_column("outcome")
    table.add_column("requests", justify="right")
    table.add_column("share", justify="right")
    for kind, n in counts.items():
        share = f"{100.0 * n / total:.1f}%" if total else "-"
        table.add_row(kind.replace("_", " "), _num(n), share)
    return table


def _header(card: Card) -> Text:
    env = card.environment
    text = Text.assemble(
        ("Report card ", "bold"), (card.run_id, "bold cyan"), "  ", verdict_text(card.headline)
    )
    engine = env.engine_line() if env.engine else "engine not recorded"
    text.append(
        f"\n{engine} | model {env.model or '?'} | workload {env.workload_name or '?'} | "
        f"window {_num(card.window_s, 1)} s"
    )
    return text


def _health_line(card: Card) -> Text:
    h = card.client_health
    style = "bold red" if h.client_bound else "dim"
    text = Text(
        f"client queueing (scheduled to sent) p50 {_num(h.dispatch_lag_p50_ms, 3)} ms, p99 "
        f"{_num(h.dispatch_lag_p99_ms, 3)} ms; client bound: {_num(h.client_bound)}",
        style=style,
    )
    for w in h.workers:
        line = (
            f"\n  worker {w['worker']}{' on node ' + str(w['node'])[:12] if w['node'] else ''}: "
            f"{_num(w['requests'])} requests, queueing p50 {_num(w['dispatch_lag_p50_ms'], 3)} "
            f"ms, p99 {_num(w['dispatch_lag_p99_ms'], 3)} ms"
        )
        if w["clock_offset_ms"] is not None:
            line += (
                f"; clock offset {_num(w['clock_offset_ms'], 3)} "
                f"+/- {_num(w['clock_uncertainty_ms'], 3)} ms"
            )
        text.append(
            line + ("; DIED mid-run" if w["died"] else ""), style="red" if w["died"] else "dim"
        )
    return text


def card_renderable(card: Card) -> RenderableType:
    """The card as a rich Group: header, notes, SLO, throughput, latency, outcomes, health."""
    parts: list[RenderableType] = [_header(card)]
    parts += [Text(f"! {note}", style="yellow") for note in card.notes]
    if card.slo_verdicts:
        parts.append(slo_table(card.slo_verdicts, card.slo_name))
    parts.append(throughput_table(card.throughput, card.goodput))
    parts.append(latency_table(card.latency))
    undefined = undefined_sentence(card.undefined_metrics, LATENCY_METRICS)
    if undefined:
        parts.append(Text(undefined, style="dim"))
    dense = dense_renderable(card.dense)
    if dense is not None:
        parts.append(dense)
    if card.chunking_sentence():
        parts.append(Text(card.chunking_sentence(), style="dim"))
    counts = {kind: getattr(card.failures, kind) for kind in OUTCOME_KINDS}
    parts.append(outcomes_table(counts, card.failures.total))
    for name, message in card.failures.first_message_by_error_class.items():
        parts.append(Text(f"  first {name}: {message}", style="dim"))
    if card.faults:
        parts.append(faults_table(card.faults))
    if card.ledger:
        parts.append(ledger_text(card.ledger))
    parts += checks_renderables(card.server_metrics, card.correctness)
    sessions = sessions_renderable(card.sessions)
    if sessions is not None:
        parts.append(sessions)
    classes = classes_renderable(card.fairness, card.deadlines)
    if classes is not None:
        parts.append(classes)
    overload = overload_renderable(card.overload)
    if overload is not None:
        parts.append(overload)
    memory = memory_renderable(card.memory)
    if memory is not None:
        parts.append(memory)
    reasoning = reasoning_renderable(card.reasoning)
    if reasoning is not None:
        parts.append(reasoning)
    disaggregation = disaggregation_renderable(card.disaggregation)
    if disaggregation is not None:
        parts.append(disaggregation)
    bounds = bounds_renderable(card.bounds)
    if bounds is not None:
        parts.append(bounds)
    parts.append(Text(""))
    parts.append(_health_line(card))
    return _spaced(parts)


def ledger_text(ledger: Ledger) -> Text:
    """`ledger ok: 60 scheduled, 0 lost, 0 unexpected, 0 leaked` (red when it failed)."""
    verdict = ledger.verdict
    style = {"ok": "green", "failed": "bold red"}.get(verdict, "dim")
    if ledger.scheduled is None:
        text = f"ledger {verdict}: the run kept no schedule to check; leaked = {ledger.leaked}"
    else:
        text = (
            f"ledger {verdict}: {ledger.scheduled} scheduled, lost = {ledger.lost}, "
            f"unexpected = {ledger.unexpected}, leaked = {ledger.leaked}"
        )
    leak = ledger.leak or LeakCheck.empty()
    if not leak.checked:
        text += " (the target has no /metrics to check for leaks)"
    elif leak.reasons:
        text += " (" + "; ".join(leak.reasons) + ")"
    return Text(text, style=style)


def faults_table(windows: list[FaultWindow]) -> Table:
    """One row per applied fault window: when, goodput before and during, recovery time."""
    table = _table()
    for name in ("fault", "from s", "to s", "goodput before/s", "during/s", "recovered after s",
                 "ok in window", "outcomes in window"):  # fmt: skip
        table.add_column(
            name, justify="left" if name in ("fault", "outcomes in window") else "right"
        )
    for w in windows:
        outcomes = ", ".join(f"{k} {v}" for k, v in (w.outcomes_in_window or {}).items())
        table.add_row(
            str(w.kind),
            _num(w.start_s, 2),
            _num(w.end_s, 2),
            _num(w.goodput_before_per_s, 2),
            _num(w.goodput_during_per_s, 2),
            recovery_text(w),
            _num(w.attainment_in_window, 3),
            outcomes or "-",
        )
    return table


def summary_renderable(summary: RunSummary) -> RenderableType:
    """The same view from a run's summary alone (no taxonomy beyond its statuses)."""
    verdicts = slo_view.verdicts(summary)
    headline = slo_view.headline(summary, verdicts, has_slo=slo_view.has_slo(summary, None))
    parts: list[RenderableType] = [Text.assemble(("Run summary  ", "bold"), verdict_text(headline))]
    if verdicts:
        parts.append(slo_table(verdicts, slo_view.slo_name(summary, None)))
    parts.append(throughput_table(throughput_rows(summary), summary.goodput))
    parts.append(latency_table(latency_rows_from_summary(summary)))
    counts = summary.counts
    parts.append(outcomes_table(dict(counts.by_status or {}), int(counts.total or 0)))
    lag = summary.dispatch_lag_ms
    parts.append(Text(""))
    parts.append(
        Text(
            f"client queueing (scheduled to sent) p50 {_num(lag.p50, 3)} ms, p99 "
            f"{_num(lag.p99, 3)} ms; client bound: {_num(summary.client_bound)}",
            style="bold red" if summary.client_bound else "dim",
        )
    )
    return _spaced(parts)


def render_summary(
    card_or_summary: Card | RunSummary | dict,
    console: Console,
    *,
    run_dir: Path | str | None = None,
) -> None:
    """Print the end-of-run summary to `console`: a Card, or a run's summary (the dict of
    `slo.summarize`, or a `RunSummary`).

    With a summary and its `run_dir`, the full card is shown (failure taxonomy, latency
    intervals, notes) without recomputing the summary; should the run directory be unreadable,
    the summary alone is shown.
    """
    if isinstance(card_or_summary, Card):
        console.print(card_renderable(card_or_summary))
        return
    summary = as_summary(card_or_summary)
    if run_dir is not None:
        try:
            card = build_card(run_dir, summary=summary)
        except ReportError:
            card = None
        if card is not None:
            console.print(card_renderable(card))
            return
    console.print(summary_renderable(summary))


def gate_renderable(result) -> RenderableType:
    """A `reports.gate.GateResult`: the overall verdict, one table row per metric (ratio is
    candidate / baseline with its bootstrap interval), then why each non-passing metric got
    its verdict."""
    table = _table()
    for name in ("metric", "base", "cand", "ratio", "95% CI", "MWU p", "verdict"):
        table.add_column(
            name, justify="left" if name in ("metric", "verdict") else "right", no_wrap=True
        )
    reasons = []
    for r in result.results:
        e = r.estimate
        defined = e.ratio == e.ratio  # NaN when the baseline is zero or undefined
        table.add_row(
            r.metric,
            _num(e.baseline),
            _num(e.candidate),
            f"{e.ratio:.3f}" if defined else "-",
            _ci(e.ci_low, e.ci_high, 2).strip() if defined else "",
            _num(r.mann_whitney_p, 4),
            verdict_text(r.verdict),
        )
        if r.verdict != "pass":
            reasons.append(Text(f"{r.metric}: {r.verdict}, {r.reason}"))
    header = Text.assemble(("Regression gate  ", "bold"), verdict_text(result.verdict))
    notes = [Text(f"! {n}", style="yellow") for n in result.notes]
    return _spaced([header, table, Text(""), *reasons, *notes])
