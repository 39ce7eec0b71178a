"""Fixtures for the slo tests; the builders live in slo_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from slo_runs import hand_requests, write_run


@pytest.fixture
def hand_run(tmp_path: Path) -> Path:
    """The `hand_requests` run written to a temporary run directory."""
    requests, chunks = hand_requests()
    return write_run(tmp_path / "run", requests, chunks)
