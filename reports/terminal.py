"""The console a `bench` command prints on, sized for where its output goes."""

from __future__ import annotations

import os

from rich.console import Console

# Columns when the output is piped: wider than any table `bench` prints (the conventions table,
# the widest, needs about 250), so tables take their natural width. Nothing fills the width:
# tables are not expanded and text is not padded, so a narrow card stays narrow.
PIPED_WIDTH = 1000


def cli_console(*, stderr: bool = False) -> Console:
    """A rich Console on stdout (stderr when `stderr`).

    On a terminal, or with `COLUMNS` set in the environment, it is rich's own: the terminal's
    width, or `COLUMNS`. Piped into a file or a CI log, where rich
    would assume 80 columns and cut table cells ('…') or wrap them mid-word, it is
    `PIPED_WIDTH` columns wide, so every cell is printed whole on its line.
    """
    console = Console(stderr=stderr)
    if console.is_terminal or os.environ.get("COLUMNS", "").strip():
        return console
    return Console(stderr=stderr, width=PIPED_WIDTH)
