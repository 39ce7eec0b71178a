"""The CI skip policy (tests/skip_policy.py) on a small generated suite run by pytest itself:
with CI=true a skip off the allowlist fails with a sentence, an allowlisted one stays a skip,
and outside CI both are skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent

SUITE = {
    "conftest.py": (
        "from skip_policy import pytest_make_collect_report, pytest_runtest_makereport  # noqa\n"
    ),
    "test_marks.py": (
        "import pytest\n"
        "@pytest.mark.skipif(True, reason='engine kernels off: the kernel build failed: x')\n"
        "def test_kernels(): pass\n"
        "def test_model():\n"
        "    pytest.skip('SmolLM2 model file unavailable: hash differs')\n"
        "def test_venv():\n"
        "    pytest.skip('BENCH_VLLM_PYTHON does not name the Python of a venv with the engine"
        " installed')\n"
        "def test_runs(): assert True\n"
    ),
    "test_module_skip.py": (
        "import pytest\npytest.importorskip('a_module_that_is_not_installed_anywhere')\n"
        "def test_never(): pass\n"
    ),
}


def _run(tmp_path: Path, ci: str | None, test_file: str) -> subprocess.CompletedProcess:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in {"CI", "PYTEST_ADDOPTS"}}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
         "-p", "no:randomly", "-o", "addopts=", test_file],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip


def test_in_ci_a_skip_off_the_allowlist_fails_with_its_reason(tmp_path):
    proc = _run(tmp_path, "true", "test_marks.py")
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "ERROR test_marks.py::test_kernels" in out  # a skip mark: in setup
    assert "FAILED test_marks.py::test_model" in out
    assert "engine kernels off: the kernel build failed: x" in out
    assert "not on the skip allowlist" in out
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and "BENCH_VLLM_PYTHON" in skipped[0], skipped
    assert "1 failed, 1 passed, 1 skipped, 1 error" in out


def test_in_ci_a_module_level_skip_fails_its_collection(tmp_path):
    proc = _run(tmp_path, "true", "test_module_skip.py")
    assert proc.returncode == 2, proc.stdout  # pytest's "interrupted": a collection error
    assert "ERROR test_module_skip.py" in proc.stdout
    assert "a_module_that_is_not_installed_anywhere" in proc.stdout


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_every_skip_stays_a_skip(tmp_path, ci):
    proc = _run(tmp_path, ci, ".")
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 4 skipped" in proc.stdout
