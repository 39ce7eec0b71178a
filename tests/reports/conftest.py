"""Fixtures for the reports tests: synthetic run directories from rundir_builder.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from rundir_builder import SyntheticRun, write_run

# The fixed run behind the golden files: every failure kind, a fault window, a capacity curve.
GOLDEN_SPEC = SyntheticRun(
    n_requests=120,
    seed=0,
    failures={"rejected": 3, "timeout": 2, "oom": 1, "cancelled": 1, "unknown": 1, "http_5xx": 1},
    wrong_output=2,
    fault_windows=[{"start_s": 4.0, "end_s": 6.0, "kind": "latency"}],
    capacity=[
        {"rate": 2.0, "attainment": 1.0, "goodput": 2.0},
        {"rate": 4.0, "attainment": 0.99, "goodput": 3.96},
        {"rate": 8.0, "attainment": 0.91, "goodput": 7.3},
        {"rate": 16.0, "attainment": 0.42, "goodput": 6.7},
    ],
)


@pytest.fixture(scope="session")
def golden_run(tmp_path_factory) -> Path:
    """The GOLDEN_SPEC run, written once per session under the name `golden-run`."""
    return write_run(tmp_path_factory.mktemp("runs") / "golden-run", GOLDEN_SPEC)
