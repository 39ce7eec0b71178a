"""Fixtures for the reports tests: synthetic run directories from rundir_builder.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from rundir_builder import GOLDEN_SPEC, write_run


@pytest.fixture(scope="session")
def golden_run(tmp_path_factory) -> Path:
    """The GOLDEN_SPEC run, written once per session under the name `golden-run`."""
    return write_run(tmp_path_factory.mktemp("runs") / "golden-run", GOLDEN_SPEC)
