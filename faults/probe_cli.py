"""`bench probe bad-input`: a thin layer over `faults.probe`, and the report's console table.

Exit status: 0 when every case passed and the background streams were unaffected, 1 when
anything failed (the table says which and why), 2 when the probe could not run (one sentence).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from faults.probe_cases.case import Category
from faults.probe_report import Verdict
from reports.terminal import cli_console

if TYPE_CHECKING:
    from faults.probe_report import ProbeReport

EXAMPLES = """
\b
Examples:
  bench probe bad-input --url http://127.0.0.1:8000
  bench probe bad-input --url http://127.0.0.1:8000/v1 --only limits --only encoding
  bench probe bad-input --url http://127.0.0.1:8000 --json probe.json --timeout 30
"""


class ProbeUsageError(click.ClickException):
    exit_code = 2


@click.group(name="probe")
def probe() -> None:
    """Probe a server's robustness."""


@probe.command(name="bad-input", epilog=EXAMPLES)
@click.option("--url", required=True, help="The server root or its /v1 base URL.")
@click.option("--model", help="Model name to send (default: the first id /v1/models lists).")
@click.option("--api-key", envvar="OPENAI_API_KEY", help="Bearer token (default: $OPENAI_API_KEY).")
@click.option(
    "--json",
    "json_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Also write the report as JSON to this file.",
)
@click.option(
    "--timeout", "timeout_s", type=float, help="Seconds each request may take (default 10)."
)
@click.option(
    "--all",
    "all_cases",
    is_flag=True,
    help="List every case on the console, not only the failing ones.",
)
@click.option(
    "--only",
    type=click.Choice([c.value for c in Category]),
    multiple=True,
    help="Run only this category of cases (repeatable).",
)
def bad_input(
    url: str,
    model: str | None,
    api_key: str | None,
    json_path: Path | None,
    timeout_s: float | None,
    only: tuple[str, ...],
    all_cases: bool,
) -> None:
    """Send malformed, mistyped, extreme and oversized requests; check each gets a 4xx with an
    OpenAI error body (or, where declared, a 200) and that the server stays healthy and keeps
    answering a reference request, and concurrent streams, the same."""
    from faults.probe import ProbeConfig, ProbeError, run_probe

    options = {"model": model, "api_key": api_key, "timeout_s": timeout_s}
    try:
        config = ProbeConfig(
            url=url,
            only=frozenset(Category(c) for c in only),
            **{k: v for k, v in options.items() if v is not None},
        )
        report = asyncio.run(_run_with_progress(config, run_probe))
    except ProbeError as exc:
        raise ProbeUsageError(str(exc)) from None
    cli_console().print(render_report(report, all_cases=all_cases))
    if json_path is not None:
        try:
            json_path.write_text(report.to_json() + "\n", encoding="utf-8")
        except OSError as exc:
            raise ProbeUsageError(f"Cannot write {json_path}: {exc.strerror}.") from None
    sys.exit(0 if report.passed else 1)


async def _run_with_progress(config, run_probe) -> ProbeReport:
    """Run the probe; on a terminal, a status line counts the cases as they finish."""
    console = Console(stderr=True)
    if not console.is_terminal:
        return await run_probe(config)
    done: list[str] = []
    with console.status("probing...") as status:

        def on_result(result) -> None:
            done.append(result.name)
            status.update(f"probing: {len(done)} cases done, last {result.name}")

        return await run_probe(config, on_result=on_result)


def render_report(report: ProbeReport, *, all_cases: bool = False) -> RenderableType:
    """The console view: passes and failures per category, then each failing case with its
    reason (every case, when `all_cases`), then the background streams and a verdict line."""
    tables: list[RenderableType] = []
    title = f"bad-input probe of {report.url} ({report.model})"
    if all_cases:
        tables.append(_case_table(title, report.results, with_category=True))
    else:
        tables.append(_category_table(title, report))
        failed_cases = [r for r in report.results if r.verdict is Verdict.FAIL]
        if failed_cases:
            tables.append(_case_table("failed cases", failed_cases, with_category=False))
    streams = report.streams
    longest = "" if streams.max_latency_ms is None else f", longest {streams.max_latency_ms:.0f} ms"
    lines = [
        Text(
            f"background streams: {streams.num_streams}, {streams.num_completed} requests answered "
            f"with the reference text, {streams.num_failed} failed{longest}.",
            style="" if streams.passed else "bold red",
        )
    ]
    lines += [
        Text(f"  {f.reason} (during: {', '.join(f.during) or 'no case'})", style="red")
        for f in streams.failures
    ]
    failed = report.failed
    unserved = len(report.not_served)
    if report.passed and unserved:
        served = len(report.results) - unserved
        sentence = (
            f"all {served} cases served passed; {unserved} not served (their route is not there)."
        )
        lines.append(Text(sentence, style="bold green"))
    elif report.passed:
        lines.append(Text(f"all {len(report.results)} cases passed.", style="bold green"))
    else:
        names = ", ".join(r.name for r in failed)
        summary = f"{len(failed)} of {len(report.results)} cases failed"
        lines.append(
            Text(f"{summary}: {names}." if failed else "the streams failed.", style="bold red")
        )
    return Group(*tables, *lines)


def _category_table(title: str, report: ProbeReport) -> Table:
    table = Table(title=title, title_justify="left")
    for name, justify in (("category", "left"), ("cases", "right"), ("passed", "right"),
                          ("failed", "right")):  # fmt: skip
        table.add_column(name, justify=justify, no_wrap=True)
    by_category: dict[str, list[int]] = {}
    for r in report.results:
        counts = by_category.setdefault(r.category.value, [0, 0, 0])
        counts[(Verdict.PASS, Verdict.FAIL, Verdict.NOT_SERVED).index(r.verdict)] += 1
    for category, (passed, failed, unserved) in by_category.items():
        style = "bold red" if failed else ""
        name = f"{category} ({unserved} not served)" if unserved else category
        table.add_row(
            name, str(passed + failed + unserved), str(passed), Text(str(failed), style=style)
        )
    return table


def _case_table(title: str, results, *, with_category: bool) -> Table:
    table = Table(title=title, title_justify="left")
    columns = [("case", {"no_wrap": True})]
    if with_category:
        columns.append(("category", {"no_wrap": True}))
    columns += [("status", {"justify": "right"}), ("verdict", {}), ("ms", {"justify": "right"}),
                ("reason", {"ratio": 1, "min_width": 24})]  # fmt: skip
    for name, kwargs in columns:
        table.add_column(name, **kwargs)
    for r in results:
        passed = r.verdict == Verdict.PASS
        cells = [r.name, *([r.category.value] if with_category else [])]
        table.add_row(
            *cells,
            "-" if r.status is None else str(r.status),
            Text(r.verdict.value, style="green" if passed else "bold red"),
            "-" if r.latency_ms is None else f"{r.latency_ms:.0f}",
            r.reason,
        )
    return table
