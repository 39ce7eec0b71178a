"""`bench sweep`: runs at several request rates or concurrencies against one target, and the
sweep card (points table, Pareto chart) written into the sweep directory."""

from __future__ import annotations

from pathlib import Path

import click

from harness.cli.options import target_and_workload_options
from harness.cli.targets import one_target_options
from harness.errors import HarnessError

EXAMPLES = """
\b
Examples:
  bench sweep --request-rate 1,2,4,8 --num-requests 64 --workload sharegpt
  bench sweep --concurrency 1,4,16,64 --repeat 3 --url http://127.0.0.1:8000/v1
"""


@click.command(epilog=EXAMPLES)
@target_and_workload_options
@one_target_options
@click.option(
    "--request-rate", "rates", help="Comma list of request rates (requests/s; inf allowed)."
)
@click.option(
    "--concurrency", "concurrencies", help="Comma list of concurrencies (closed-loop users)."
)
@click.option("--repeat", type=int, default=1, show_default=True, help="Runs per load point.")
@click.option("--slo", help="SLO spec (built-in name or YAML file) for goodput and attainment.")
@click.option(
    "--range-ratio", type=float, help="Uniform length spread, as vLLM's --random-range-ratio."
)
@click.option("--dataset-path", help="Dataset or trace file for workloads that read one.")
@click.option("--warmup", type=int, help="Warm-up requests before each point's measured phase.")
@click.option("--no-stream", is_flag=True, help="Use non-streaming requests.")
@click.option(
    "--out", type=click.Path(path_type=Path), help="Sweep directory (default runs/<time>-sweep)."
)
def sweep(rates, concurrencies, repeat, no_stream, out, server_args, **kwargs) -> None:
    """Run one benchmark per load point against one started target; write the sweep card.

    Each point is a full run directory inside the sweep directory; `sweep.json` lists them,
    `sweep.html` and `sweep_card.json` are the card (throughput, latency percentiles and
    goodput per point, and a Pareto chart of output tokens/s per user against total).
    """
    from harness.run.config import RunConfig
    from harness.run.sweep import SweepPlan, run_sweep

    if (rates is None) == (concurrencies is None):
        raise HarnessError("bench sweep needs one of --request-rate LIST or --concurrency LIST.")
    kind, text = ("request_rate", rates) if rates is not None else ("concurrency", concurrencies)
    plan = SweepPlan.parse(kind, text, repeat)
    config = RunConfig(stream=not no_stream, server_args=server_args,
                       **{k: v for k, v in kwargs.items() if v is not None})  # fmt: skip
    sweep_dir = run_sweep(config, plan, out=out, progress=lambda line: click.echo(line, err=True))
    html, card_json = write_sweep_card(sweep_dir)
    click.echo(f"sweep card: {html} ({card_json}); runs in {sweep_dir}")


def write_sweep_card(sweep_dir: Path) -> tuple[Path, Path]:
    """Write `sweep.html` and `sweep_card.json` into `sweep_dir`; returns their paths."""
    from reports.sweep import build_sweep_card
    from reports.sweep_html import render_sweep_html

    card = build_sweep_card(sweep_dir)
    html, card_json = sweep_dir / "sweep.html", sweep_dir / "sweep_card.json"
    html.write_text(render_sweep_html(card), encoding="utf-8")
    card_json.write_text(card.to_json(), encoding="utf-8")
    return html, card_json
