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


DYING_ENGINE = Path(__file__).parent / "dying_engine.py"


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """The managed vllm's export of tiny-random lands in a cache of this test's own (two tests
    exporting into one cache at once would race)."""
    monkeypatch.setenv("BENCH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()


@pytest.mark.parametrize(("die", "named"), [("segv", "SIGSEGV"), ("exit1", "code 1")])
def test_a_managed_engine_that_dies_mid_run_is_named_and_stops_the_run(
    tmp_path, fresh_cache, die, named
):
    """The engine starts, passes startup and preflight, then dies on the first completion
    request: the run stops at once (exit 3) and says how and when it died, with the end of
    its log, on the console, in the manifest and on the card; one row per scheduled request."""
    run = tmp_path / "run"
    engine = (f"vllm={{python}} {DYING_ENGINE} --port {{port}} --model {{served_model}} "
              f"--die {die}")  # fmt: skip
    start = time.monotonic()
    result = bench_run("--target", "vllm", "--engine-command", engine, "--model", "tiny-random",
                       "--workload", "random", "--input-len", "8", "--output-len", "4",
                       "--request-rate", "2", "--num-requests", "200", "--out", str(run),
                       "--quiet", timeout_s=180)  # fmt: skip
    elapsed_s = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert elapsed_s < 90, elapsed_s  # 200 requests at 2/s would take 100 s
    assert "Traceback" not in output
    said = f"the managed vllm exited with {named}"
    assert said in result.stderr and "s into the run; last lines of server.log:" in result.stderr
    assert f"dying by {die}" in result.stderr  # the last line the engine wrote to its log
    statuses = one_row_per_scheduled(run)
    assert sum(statuses.values()) == 200 and statuses["not_sent"] >= 190, statuses
    manifest = json.loads((run / "manifest.json").read_text())
    assert said in manifest["interrupted_reason"] and manifest["outcome"]["exit_code"] == 3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["run_complete"] is False
    assert (summary["ledger"]["lost"], summary["ledger"]["unexpected"]) == (0, 0)
    card = tmp_path / "card.json"
    shown = subprocess.run([sys.executable, "-m", "harness.cli", "report", str(run), "--json",
                            str(card)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert any(said in note for note in json.loads(card.read_text())["notes"])
