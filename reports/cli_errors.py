"""How the reports commands (`bench report`, `bench compare`, `bench export`) end on a problem a
user can cause: one sentence on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from reports.errors import ReportError
from slo.errors import SLOError

USAGE_ERROR_EXIT = 2


def user_errors(command):
    """Decorate a click command: a ReportError or SLOError it raises becomes `Error: <its
    sentence>` on stderr and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (ReportError, SLOError) as exc:
            click.echo(f"Error: {exc}", err=True)
            raise SystemExit(USAGE_ERROR_EXIT) from None

    return wrapper


def write_output(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to the output file `path`; a path that cannot be written raises a
    ReportError that names it and the fix."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ReportError(
            f"cannot write {path} ({exc.strerror}); choose a writable path."
        ) from None
