"""`bench history`: add runs to the history, list it, show a metric's trend, write the trend card,
and gate a new run against the recent runs (a thin layer over `reports.history`).

A problem a user can cause (a path that is not a run, an unknown metric, a database that is
not a history) ends in one sentence and exit code 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from reports.cli_errors import user_errors, write_output
from reports.errors import ReportError
from reports.history.catalogue import DEFAULT_REPORT_METRICS, resolve_metric
from reports.history.record import read_run
from reports.history.series import SeriesFilter, group_series, one_series, select_series
from reports.history.store import HistoryStore, default_history_path
from reports.terminal import cli_console

# The trend modules (matplotlib, the two-run gate) are imported by the commands that use them,
# so `bench history add` starts fast: CI jobs add runs in parallel.
DEFAULT_WINDOW = 20  # reports.history.trend.DEFAULT_WINDOW (a test checks they agree)
ADD_BATCH = 10  # runs written per transaction

_OUT_FILE = click.Path(dir_okay=False, path_type=Path)


def history_option(command):
    return click.option(
        "--history",
        "history_path",
        type=click.Path(dir_okay=False, path_type=Path),
        help="History database file (default: history/history.duckdb under the cache root, "
        "$BENCH_CACHE_DIR).",
    )(command)


def series_options(command):
    for name, text in reversed((
        ("--workload", "Workload name or a prefix of its table hash."),
        ("--target", "Engine, engine version, or 'engine version'."),
        ("--model", "Model name or a prefix of its hash."),
        ("--hardware", "Part of the CPU or GPU name."),
        ("--series", "A prefix of the series id (bench history list)."),
    )):  # fmt: skip
        command = click.option(name, help=text)(command)
    return command


def _store(history_path: Path | None) -> HistoryStore:
    return HistoryStore(history_path or default_history_path())


def _config(metrics: tuple[str, ...] | None = None, **settings):
    from reports.history.trend import TrendConfig

    try:
        return TrendConfig(**({"metrics": metrics} if metrics else {}), **settings)
    except ValueError as exc:
        raise ReportError(f"{exc}") from None


@click.group("history")
def history() -> None:
    """A run history in one database file: add runs, list them, show trends, gate a new run.

    Runs line up in a series only when they share the workload (table hash), the engine and
    its version, the model and the hardware."""


@history.command("add")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@history_option
@user_errors
def add(runs: tuple[Path, ...], history_path) -> None:
    """Add the run directories RUNS (a run already in the history is left as it is)."""
    records = [read_run(path) for path in runs]  # all read first: a bad one adds nothing
    store = _store(history_path)
    added, present = [], []
    # a transaction per batch: the file is held a moment at a time, and a second process
    # adding at once interleaves with this one instead of waiting for all of it
    for start in range(0, len(records), ADD_BATCH):
        result = store.add(records[start : start + ADD_BATCH])
        added += result.added
        present += result.present
    click.echo(
        f"added {len(added)} run(s) to {store.path}"
        + (f"; {len(present)} already present" if present else "")
        + "."
    )


@history.command("list")
@history_option
@click.option("--runs", "show_runs", is_flag=True, help="Also list every run.")
@user_errors
def list_(history_path, show_runs: bool) -> None:
    """The series in the history (and, with --runs, every run)."""
    from reports.history.views import runs_table, series_table

    store = _store(history_path)
    runs = store.runs()
    console = cli_console()
    if not runs:
        console.print(f"{store.path} holds no runs yet.")
        return
    console.print(series_table(group_series(runs)))
    if show_runs:
        console.print(runs_table(runs))


@history.command("show")
@click.option("--metric", required=True, help="e.g. ttft_p99, output_tokens_per_s, attainment.")
@series_options
@history_option
@click.option("--json", "json_path", type=_OUT_FILE, help="Also write the trend as JSON.")
@user_errors
def show(metric: str, history_path, json_path, **keys) -> None:
    """One metric over the runs of one series, each with its interval, shifts marked.

    Without enough keys to pick one series, lists those that match and the option to add."""
    from reports.history.trend_card import metric_trend
    from reports.history.views import trend_table

    wanted = resolve_metric(metric)
    runs = one_series(_store(history_path).runs(), SeriesFilter(**keys))
    trend = metric_trend(runs, wanted, _config())
    if not trend.points:
        raise ReportError(f"no run of this series has {wanted.key} (goodput needs an SLO).")
    cli_console().print(trend_table(trend, runs[0].key.label))
    if json_path:
        data = {"series": runs[0].key.series_id, "label": runs[0].key.label, **trend.to_dict()}
        write_output(json_path, json.dumps(data, indent=2) + "\n")


@history.command("report")
@click.option("-o", "--output", "html_path", type=_OUT_FILE, required=True,
              help="Write the trend card (HTML) here.")  # fmt: skip
@click.option("--metric", "metrics", multiple=True,
              help=f"Metric to chart (repeatable; default {', '.join(DEFAULT_REPORT_METRICS)}).")  # fmt: skip
@series_options
@history_option
@user_errors
def report(html_path: Path, metrics: tuple[str, ...], history_path, **keys) -> None:
    """A self-contained HTML trend card: per series, each metric over time with intervals."""
    from reports.history.trend_card import render_trend_html

    chosen = tuple(resolve_metric(m).key for m in metrics) or DEFAULT_REPORT_METRICS
    groups = select_series(_store(history_path).runs(), SeriesFilter(**keys))
    write_output(html_path, render_trend_html(groups, chosen, _config()))
    cli_console().print(f"Wrote {html_path}")


@history.command("gate")
@click.argument("run")
@click.option("--window", type=int, default=DEFAULT_WINDOW, show_default=True,
              help="How many recent comparable runs the candidate is judged against.")  # fmt: skip
@click.option(
    "--metric",
    "metrics",
    multiple=True,
    help="Metric to judge (repeatable; default: the gate's set).",
)
@click.option("--add", "add_run", is_flag=True, help="Add RUN to the history after judging it.")
@click.option("--json", "json_path", type=_OUT_FILE, help="Write the result as JSON.")
@history_option
@user_errors
def gate(run: str, window: int, metrics, add_run: bool, json_path, history_path) -> None:
    """Judge RUN (a run directory, or the id of a run in the history) against the recent
    comparable runs of the history, with change-point detection.

    \b
    Exit codes:
      0  pass (no metric regressed or was inconclusive)
      1  regression (a new level, shared by this run and earlier ones, is worse)
      2  usage error (not a run, unknown metric, unreadable history)
      3  inconclusive (no comparable runs, or this run alone is beyond the recent ones)
    """
    raise SystemExit(judge(run, window, metrics, add_run, json_path, history_path))


def judge(run: str, window: int, metrics, add_run: bool, json_path, history_path) -> int:
    """`bench history gate` (and `bench compare --history`): print the verdict on `run`
    against the history's recent comparable runs and return the gate's exit code."""
    from reports.history.trend import trend_gate
    from reports.history.views import gate_dict, gate_table

    store = _store(history_path)
    history_runs = store.runs() if store.exists else []
    if Path(run).exists():
        candidate = read_run(run)
    else:
        by_id = {r.run_id: r for r in history_runs}
        if run not in by_id:
            raise ReportError(
                f"{run} is neither a run directory nor the id of a run in {store.path}."
            )
        candidate = by_id[run]
    result = trend_gate(history_runs, candidate, _config(tuple(metrics), window=window))
    console = cli_console()
    console.print(gate_table(result))
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")
    if json_path:
        write_output(json_path, json.dumps(gate_dict(result), indent=2) + "\n")
    if add_run:
        store.add([candidate])
    return result.exit_code
