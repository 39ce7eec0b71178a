"""No silent skips in CI. With `CI=true` (as `.ci/run` runs on a fresh clone), a test or module
that skips fails instead, unless its reason matches an entry of `ALLOWED`: a missing compiler,
extra, kernel build or model file would otherwise turn hundreds of tests into skips and leave
the run green. The allowlist names what CI cannot have by design; README's "Tests" section
lists the same entries.
"""

from __future__ import annotations

import os
import re

import pytest

# (what is missing, pattern of the skip reason). Keep it short: each entry is a feature CI
# does not check, so each one must be something CI cannot provide.
ALLOWED: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a real vLLM or llama.cpp venv is not named (BENCH_VLLM_PYTHON, BENCH_LLAMACPP_PYTHON)",
     re.compile(r"BENCH_(VLLM|LLAMACPP)_PYTHON does not name the Python of a venv")),
    ("no CUDA device (or a CPU-only check on a machine that has one)",
     re.compile(r"no CUDA device|this machine has CUDA")),
    ("the shared data folder is not beside the clone",
     re.compile(r"shared/data not beside the clone")),
)  # fmt: skip


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def allowed(reason: str) -> bool:
    return any(pattern.search(reason) for _, pattern in ALLOWED)


def _fail_unless_allowed(report) -> None:
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if allowed(reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"This test skipped in CI ({reason}), and that reason is not on the skip allowlist "
        "in tests/skip_policy.py: CI must run it, so install or fix what it needs."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_unless_allowed(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_unless_allowed(outcome.get_result())
