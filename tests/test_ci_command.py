"""`.ci/run` runs exactly the README's test command, and that command runs both tiers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(python -m pip install torch[^\n]*)\n```", text)


def test_ci_runs_the_readme_test_command_verbatim():
    main_job, tests = _readme_commands()[:2]
    assert "bench run --workload sharegpt --slo p99.yaml" in main_job
    assert "pytest" in tests
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines, "the README's test command is not a line of .ci/run"


def test_the_test_command_runs_the_parallel_and_the_serial_tier():
    tests = _readme_commands()[1]
    runs = [part.strip() for part in tests.split("&&") if "pytest" in part]
    assert runs == [
        'python -m pytest -q -n 2 --dist worksteal -m "not serial"',
        "python -m pytest -q -m serial",
    ]
