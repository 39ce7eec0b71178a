"""The `bench run --url` command line the subprocess tests start (as a user types it)."""

from __future__ import annotations

import sys
from pathlib import Path


def bench_run_command(url: str, out: Path, *args: str) -> list[str]:
    """`python -m harness.cli run --url URL *args --out OUT`."""
    return [sys.executable, "-m", "harness.cli", "run", "--url", url, *args, "--out", str(out)]
