"""`bench run`'s target and output-check options (defaults live in `RunConfig`)."""

from __future__ import annotations

import click

_TARGET_HELP = (
    "What to drive: ref (the reference engine, started for you), vllm or llamacpp (started "
    "from their command templates), or url:http://HOST:PORT/v1."
)
_LAUNCH = (
    click.option(
        "--engine-command",
        "engine_commands",
        multiple=True,
        help="ENGINE=TEMPLATE: the command line that starts vllm or llamacpp (fields {python}, "
        "{model_dir}, {gguf}, {served_model}, {host}, {port}).",
    ),
    click.option(
        "--engine-python",
        "engine_pythons",
        multiple=True,
        help="ENGINE=PATH: the Python of the engine's own venv, e.g. vllm=/opt/vllm/bin/python.",
    ),
    click.option(
        "--startup-timeout",
        "startup_timeout_s",
        type=float,
        help="Seconds a managed server has to answer before the run gives up.",
    ),
)
_OPTIONS = (
    click.option(
        "--target",
        "targets",
        multiple=True,
        help=_TARGET_HELP + " Repeat it to compare targets on the same workload.",
    ),
    click.option(
        "--repeat",
        type=int,
        default=1,
        show_default=True,
        help="Run each target this many times, interleaved (A B B A ...), into one comparative card.",
    ),
    *_LAUNCH,
    click.option(
        "--check-outputs",
        is_flag=True,
        default=None,
        help="Greedy requests; compare each output with the reference engine's batch-1 output "
        "(any wrong output: exit 1).",
    ),
    click.option(
        "--diverge-before",
        type=int,
        help="With --check-outputs: an output diverging before this token is `wrong output`.",
    ),
)


def run_comparative_command(
    config, targets: tuple[str, ...], repeat: int, console, quiet: bool, extensions=None
) -> int:
    """`bench run` with several targets or repetitions: run them (each with `extensions`),
    print the comparative table and where the card is; returns the exit code."""
    from harness.run.comparative import run_comparative
    from reports.repeated import compare_repeated, repeated_table

    outcome = run_comparative(
        config, list(targets), repeat, console=console, quiet=quiet, extensions=extensions
    )
    if not quiet:
        console.print(repeated_table(compare_repeated(outcome.runs, outcome.order)))
    if outcome.interrupted_reason:
        click.echo(f"stopped early ({outcome.interrupted_reason}).", err=True)
    click.echo(f"comparative card: {outcome.out_dir / 'comparison.html'}")
    return outcome.exit_code


def target_options(command):
    """Add the target and output-check options to a command."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def one_target_options(command):
    """`--target` (one: `bench sweep` and `bench capacity` start it once for every run) and
    the managed engines' launch options."""
    for option in reversed((click.option("--target", help=_TARGET_HELP), *_LAUNCH)):
        command = option(command)
    return command
