"""`bench capacity`: the highest request rate at which SLO attainment meets its target."""

from __future__ import annotations

from pathlib import Path

import click

from harness.cli.options import target_and_workload_options
from harness.cli.targets import one_target_options
from harness.errors import HarnessError


@click.command()
@click.option(
    "--slo",
    required=True,
    help="SLO spec (built-in name or YAML file); its attainment target is searched for.",
)
@target_and_workload_options
@one_target_options
@click.option(
    "--start-rate",
    type=float,
    default=1.0,
    show_default=True,
    help="First rate probed (requests/s).",
)
@click.option("--max-rate", type=float, help="Never probe above this rate.")
@click.option(
    "--max-iterations",
    type=int,
    default=16,
    show_default=True,
    help="Probe runs in all, the confirming run included.",
)
@click.option(
    "--rel-width",
    type=float,
    default=0.025,
    show_default=True,
    help="Stop bisecting at this relative bracket width.",
)
@click.option(
    "--out", type=click.Path(path_type=Path), help="Directory for the probe runs and capacity.json."
)
@click.option("--quiet", is_flag=True)
def capacity(
    slo, start_rate, max_rate, max_iterations, rel_width, out, quiet, server_args, **kwargs
) -> None:
    """Search the request rate: exponential ramp, then bisection, bracket re-checks, a confirming run."""
    from harness.run.capacity import run_capacity_search
    from harness.run.config import RunConfig

    config = RunConfig(
        slo=slo, server_args=server_args, **{k: v for k, v in kwargs.items() if v is not None}
    )
    try:
        result = run_capacity_search(config, out=out, start_rate=start_rate, max_rate=max_rate,
                                     max_iterations=max_iterations, rel_width=rel_width,
                                     progress=None if quiet else click.echo)  # fmt: skip
    except ValueError as exc:
        raise HarnessError(f"{exc}.") from exc
    found = result.result
    cap = found.capacity_rate_per_s
    if cap is None:
        click.echo(f"capacity: none found ({found.stop_reason})")
    else:
        verdict = "confirmed" if found.confirmed else "not confirmed by the final run"
        click.echo(f"capacity: {cap:.4g} requests/s ({verdict}; {found.stop_reason})")
    click.echo(f"curve and probe runs: {result.out_dir}")
