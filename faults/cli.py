"""`bench faults ...`: list and show fault plans (a thin layer over `faults.plan`)."""

from __future__ import annotations

from pathlib import Path

import click

from faults.plan import FaultPlanError, builtin_plan_names, builtin_plan_text, load_plan


class FaultsCliError(click.ClickException):
    exit_code = 2


@click.group(name="faults")
def faults() -> None:
    """List and show fault plans."""


@faults.command(name="list")
def list_cmd() -> None:
    """List the built-in fault plans, each with the first line of its description."""
    for name in builtin_plan_names():
        desc = " ".join(load_plan(name).description.split())
        short = desc if len(desc) <= 96 else desc[:95].rsplit(" ", 1)[0] + " ..."
        click.echo(f"{name:<18} {short}")


@faults.command(name="show")
@click.argument("name")
def show_cmd(name: str) -> None:
    """Show a fault plan's YAML: a built-in name or a plan file (checked first)."""
    try:
        load_plan(name)
        path = Path(name)
        text = path.read_text(encoding="utf-8") if path.is_file() else builtin_plan_text(name)
    except FaultPlanError as exc:
        raise FaultsCliError(str(exc)) from None
    click.echo(text.rstrip())
