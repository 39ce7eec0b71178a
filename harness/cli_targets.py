"""`bench run`'s target and output-check options (defaults live in `RunConfig`)."""

from __future__ import annotations

import click

_OPTIONS = (
    click.option(
        "--target",
        help="What to drive: ref (the reference engine, started for you), vllm or llamacpp "
        "(started from their command templates), or url:http://HOST:PORT/v1.",
    ),
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
    click.option(
        "--check-outputs",
        is_flag=True,
        default=None,
        help="Greedy requests; compare each output with the reference engine's batch-1 output.",
    ),
    click.option(
        "--diverge-before",
        type=int,
        help="With --check-outputs: an output diverging before this token is `wrong output`.",
    ),
)


def target_options(command):
    """Add the target and output-check options to a command."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command
