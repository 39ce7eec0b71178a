"""`bench report` and `bench compare`: thin click commands over the reports API.

The lead wires them into the `bench` group (harness/cli.py). Problems a user can cause end in
one sentence on stderr and exit code 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from reports.build import build_card
from reports.cli_errors import user_errors, write_output
from reports.compare import compare_runs
from reports.console import card_renderable, gate_renderable
from reports.gate import run_gate
from reports.gate_config import GateConfig, load_gate_config
from reports.gate_report import to_dict, to_junit_xml, to_markdown
from reports.html import render_comparison_html, render_html
from reports.terminal import cli_console
from slo.spec import load_slo

_RUN_DIR = click.Path(exists=True, file_okay=False, path_type=Path)
_OUT_FILE = click.Path(dir_okay=False, path_type=Path)


@click.command("report")
@click.argument("runs", nargs=-1, required=True, type=_RUN_DIR)
@click.option("-o", "--output", "html_path", type=_OUT_FILE, help="Write the HTML card here.")
@click.option("--json", "json_path", type=_OUT_FILE, help="Write the JSON card here.")
@click.option(
    "--allow-mismatch",
    is_flag=True,
    help="Compare runs whose workload hashes or SLOs differ; the card says so.",
)
@click.option(
    "--conventions",
    is_flag=True,
    help="Also print TTFT, TPOT, ITL and throughput under vLLM's, GuideLLM's, AIPerf's and MLPerf's definitions.",
)
@user_errors
def report(
    runs: tuple[Path, ...], html_path, json_path, allow_mismatch: bool, conventions: bool
) -> None:
    """Report card of RUN, or comparative card of several RUNs side by side.

    Prints the card; -o writes a self-contained HTML file, --json the versioned JSON card.
    Several runs must share the workload (manifest workload.sha256) and SLO unless
    --allow-mismatch. Exit codes: 0 written, 2 unusable input or refused comparison.
    """
    console = cli_console()
    if len(runs) == 1:
        card = build_card(runs[0])
        console.print(card_renderable(card))
        if conventions:
            from reports.conventions_view import conventions_renderable

            console.print(conventions_renderable(card.conventions))
        html_text, json_text = (render_html(card) if html_path else None), card.to_json()
    else:
        comparison = compare_runs(list(runs), allow_mismatch=allow_mismatch)
        for card in comparison.cards:
            console.print(card_renderable(card))
            if conventions:
                from reports.conventions_view import conventions_renderable

                console.print(conventions_renderable(card.conventions))
        for sentence in comparison.mismatches:
            console.print(f"[yellow]Mismatch allowed:[/] {sentence}")
        html_text = render_comparison_html(comparison) if html_path else None
        json_text = comparison.to_json()
    if html_path:
        write_output(html_path, html_text)
        console.print(f"Wrote {html_path}")
    if json_path:
        write_output(json_path, json_text)
        console.print(f"Wrote {json_path}")


@click.command("compare")
@click.argument("baseline", type=_RUN_DIR, required=False)
@click.argument("candidate", type=_RUN_DIR, required=False)
@click.option("--history", "history_path", is_flag=False, flag_value="", default=None,
              metavar="[FILE]", help="Judge the one run given against the recent comparable "
              "runs of the run history (as bench history gate does); FILE: the history "
              "database (default: history/history.duckdb under the cache root).")  # fmt: skip
@click.option("--slo", "slo_name", help="SLO (file or built-in name) that defines goodput; "
              "default: the baseline's recorded SLO.")  # fmt: skip
@click.option("--gate", is_flag=True, help="Exit 1 on a regression, 3 when inconclusive.")
@click.option("--thresholds", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="YAML file of thresholds (see reports/gate_config.py).")  # fmt: skip
@click.option("--markdown", "markdown_path", type=_OUT_FILE, help="Write a Markdown summary.")
@click.option("--junit", "junit_path", type=_OUT_FILE, help="Write JUnit XML.")
@click.option("--json", "json_path", type=_OUT_FILE, help="Write the result as JSON.")
@click.option("--allow-mismatch", is_flag=True, help="Compare runs of different workloads.")
@user_errors
def compare(
    baseline: Path | None,
    candidate: Path | None,
    history_path: str | None,
    slo_name,
    gate: bool,
    thresholds,
    markdown_path,
    junit_path,
    json_path,
    allow_mismatch: bool,
) -> None:
    """Compare CANDIDATE against BASELINE, metric by metric.

    Each is a run directory or a directory of run directories (repetitions; whole runs are
    then resampled). Per metric: candidate/baseline with a seeded bootstrap interval,
    Mann-Whitney U where the samples allow, and a verdict (pass, regressed, improved,
    inconclusive) against the thresholds (default 5% for throughput, goodput and p50
    latencies, 10% for p99, with a 1 ms floor for TTFT and E2E, 0.1 ms for TPOT and ITL).

    \b
    Exit codes with --gate:
      0  pass (no metric regressed or was inconclusive)
      1  regression (some metric regressed)
      2  usage error (unreadable runs, different workloads, bad thresholds file)
      3  inconclusive (too few samples, or a change not told apart from noise)
    Without --gate the exit code is 0 whatever the verdict (2 on usage errors).

    With --history, `bench compare RUN --history --gate` judges RUN against the run
    history's recent comparable runs, with change-point detection (bench history gate).
    """
    if history_path and baseline is None and Path(history_path).is_dir():
        baseline, history_path = Path(history_path), ""  # `--history RUN`: the run, not a file
    if history_path is not None:
        two_run_options = {
            "--slo": slo_name, "--thresholds": thresholds, "--markdown": markdown_path,
            "--junit": junit_path, "--allow-mismatch": allow_mismatch,
        }  # fmt: skip
        used = [flag for flag, value in two_run_options.items() if value]
        _compare_with_history(baseline, candidate, history_path, gate, json_path, used)
        return
    if baseline is None or candidate is None:
        raise click.UsageError(
            "bench compare needs a BASELINE and a CANDIDATE run, or one run with --history."
        )
    config = load_gate_config(thresholds) if thresholds else GateConfig()
    spec = load_slo(slo_name) if slo_name else None
    result = run_gate(
        baseline, candidate, config=config, slo_spec=spec, allow_mismatch=allow_mismatch
    )
    cli_console().print(gate_renderable(result))
    if markdown_path:
        write_output(markdown_path, to_markdown(result))
    if junit_path:
        write_output(junit_path, to_junit_xml(result))
    if json_path:
        write_output(json_path, json.dumps(to_dict(result), indent=2) + "\n")
    if gate:
        raise SystemExit(result.exit_code)


def _compare_with_history(run: Path | None, extra: Path | None, history_path: str, gate: bool,
                          json_path, used: list[str]) -> None:  # fmt: skip
    """`bench compare RUN --history [FILE] [--gate]`: the history's trend gate on RUN.
    `used`: the two-run options given, refused here."""
    from reports.history.cli import judge
    from reports.history.trend import DEFAULT_WINDOW

    if run is None:
        raise click.UsageError("bench compare --history needs the run to judge.")
    if extra is not None:
        raise click.UsageError(
            "with --history, bench compare takes one run (judged against the history's runs), "
            f"not two; drop {extra} or --history."
        )
    if used:
        raise click.UsageError(
            f"{', '.join(used)} compare two runs and do not apply with --history; use bench "
            "history gate's options instead."
        )
    history = Path(history_path) if history_path else None
    code = judge(str(run), DEFAULT_WINDOW, (), False, json_path, history)
    if gate:
        raise SystemExit(code)
