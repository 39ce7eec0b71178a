"""How `bench run` ends, through the command line: a wrong URL stops at the first 404, a managed
engine that dies mid-run is named, wrong outputs and a broken ledger fail the run's exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow  # every test here starts a server process

FAST = ["--tokenizer", "tiny-random", "--workload", "random", "--input-len", "8", "--quiet"]


def bench_run(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "harness.cli", "run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)


def one_row_per_scheduled(run: Path) -> Counter:
    """The run's statuses, after checking every scheduled request has exactly one row."""
    scheduled = pq.read_table(run / "schedule.parquet").to_pydict()["request_id"]
    rows = pq.read_table(run / "requests.parquet").to_pydict()
    warm = pq.read_table(run / "warmup.parquet").to_pydict()["request_id"]
    assert Counter(rows["request_id"] + warm) == Counter(scheduled)
    return Counter(rows["status"])


def test_a_first_request_answered_404_stops_the_run_at_once(mock_server, tmp_path):
    """A wrong path at 2 requests/s would run 500 s; the first answer (404) ends it, exit 3,
    with the sentence naming the URL tried, and the other 999 requests are `not_sent`."""
    run = tmp_path / "run"
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        root = url.removesuffix("/v1")
        start = time.monotonic()
        result = bench_run("--url", f"{root}/wrong/v1", "--model", "mock", *FAST,
                           "--output-len", "2", "--request-rate", "2", "--num-requests", "1000",
                           "--out", str(run), timeout_s=120)  # fmt: skip
        elapsed_s = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert elapsed_s < 60, elapsed_s
    assert f"got HTTP 404 from POST {root}/wrong/v1/completions" in result.stderr
    assert "Traceback" not in output
    statuses = one_row_per_scheduled(run)
    assert sum(statuses.values()) == 1000
    assert statuses["error"] >= 1 and statuses["not_sent"] >= 990, statuses
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is False and "404" in manifest["interrupted_reason"]
    assert manifest["outcome"]["exit_code"] == 3
