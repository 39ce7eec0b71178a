"""`bench export RUN --format vllm|llmd|csv|otlp-json`: a run directory in another tool's
format."""

from __future__ import annotations

import json
from pathlib import Path

import click

from reports.cli_errors import user_errors, write_output

FORMATS = ("vllm", "llmd", "csv", "otlp-json")


@click.command("export")
@click.argument("run", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(FORMATS), required=True,
              help="vllm: `vllm bench serve --save-result` JSON; llmd: llm-d Benchmark Report "
              "v0.2.1 (JSON); csv: one row per request; otlp-json: OpenTelemetry traces (OTLP/JSON), "
              "one span per request.")  # fmt: skip
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write here (default: standard output).")  # fmt: skip
@click.option(
    "--detailed", is_flag=True, help="vllm: add the per-request arrays (--save-detailed)."
)
@user_errors
def export(run: Path, fmt: str, output: Path | None, detailed: bool) -> None:
    """Write RUN in a format other tools read. Exit codes: 0 written, 2 unusable input."""
    if fmt == "vllm":
        from reports.exports.vllm import vllm_result

        text = json.dumps(vllm_result(run, detailed=detailed), indent=2) + "\n"
    elif fmt == "llmd":
        from reports.exports.llmd import llmd_report

        text = json.dumps(llmd_report(run), indent=2) + "\n"
    elif fmt == "otlp-json":
        from reports.exports.otlp import otlp_traces

        text = json.dumps(otlp_traces(run)) + "\n"
    else:
        from reports.exports.request_csv import requests_csv

        text = requests_csv(run)
    if output is None:
        click.echo(text, nl=False)
    else:
        write_output(output, text)
        click.echo(f"wrote {output}", err=True)
