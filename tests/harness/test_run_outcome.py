"""How a run ends, through `bench run` as a user runs it: exit codes, the one-sentence
account of a failed run, the error limits, and the ledger (every scheduled request has exactly
one row; nothing invented; the target let go of everything)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cli_runs import bench_run_command

pytestmark = pytest.mark.slow

FAST = ["--tokenizer", "tiny-random", "--workload", "random", "--input-len", "8", "--quiet"]


class MockProcess:
    """`bench mock-server` in a subprocess, killable mid-run."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "harness.cli", "mock-server", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        deadline = time.monotonic() + 30
        self.url = None
        while self.url is None and time.monotonic() < deadline:
            match = re.search(
                r"listening on (http://127\.0\.0\.1:\d+)", self.proc.stderr.readline()
            )
            if match:
                self.url = match.group(1) + "/v1"
        assert self.url, "mock server did not start"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def __enter__(self) -> MockProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        self.proc.stderr.close()


def bench_run(url: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = bench_run_command(url, out, *FAST, *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def one_row_per_scheduled(run: Path) -> Counter:
    scheduled = pq.read_table(run / "schedule.parquet").to_pydict()
    rows = pq.read_table(run / "requests.parquet").to_pydict()
    warm = pq.read_table(run / "warmup.parquet").to_pydict()
    ids = rows["request_id"] + warm["request_id"]
    assert Counter(ids) == Counter(scheduled["request_id"])  # exactly one row each
    return Counter(rows["status"])


def test_a_target_that_dies_mid_run_is_a_failed_run_in_one_sentence(tmp_path):
    run = tmp_path / "run"
    with MockProcess("--ttft-ms", "2", "--itl-ms", "2") as mock:

        def kill_once_started() -> None:
            deadline = time.monotonic() + 120
            while not (run / "schedule.parquet").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # a few requests are served, the rest find nobody there
            mock.kill()

        threading.Thread(target=kill_once_started, daemon=True).start()
        result = bench_run(
            mock.url, run, "--output-len", "4", "--num-requests", "60", "--request-rate", "20"
        )
    assert result.returncode == 3, result.stderr
    sentence = [line for line in result.stderr.splitlines() if "requests failed" in line]
    assert len(sentence) == 1 and "connection_refused" in sentence[0]
    assert "Traceback" not in result.stderr
    statuses = one_row_per_scheduled(run)
    assert statuses["error"] > 30 and statuses["ok"] >= 1
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["outcome"]["exit_code"] == 3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["counts"]["first_message_by_error_class"]["connection_refused"]


def test_max_error_rate_stops_the_run_and_marks_the_rest_not_sent(tmp_path):
    run = tmp_path / "run"
    with MockProcess(
        "--ttft-ms", "2", "--itl-ms", "2", "--error-rate", "0.7", "--seed", "3"
    ) as mock:
        result = bench_run(mock.url, run, "--output-len", "4", "--num-requests", "200",
                           "--request-rate", "40", "--max-error-rate", "0.3")  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert "--max-error-rate 0.3" in result.stderr and "stopped early" in result.stderr
    statuses = one_row_per_scheduled(run)
    assert statuses["not_sent"] > 50  # stopped long before the 200th request was due
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is False and "max-error-rate" in manifest["interrupted_reason"]
    ledger = json.loads((run / "summary.json").read_text())["ledger"]
    assert (ledger["lost"], ledger["unexpected"]) == (0, 0)


def test_max_consecutive_errors_trips_the_breaker(tmp_path):
    run = tmp_path / "run"
    with MockProcess("--ttft-ms", "2", "--itl-ms", "2", "--error-rate", "1.0") as mock:
        result = bench_run(mock.url, run, "--output-len", "2", "--num-requests", "100",
                           "--request-rate", "50", "--max-consecutive-errors", "5")  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert "5 requests in a row failed" in result.stderr
    statuses = one_row_per_scheduled(run)
    assert statuses["not_sent"] > 50


def test_a_missed_slo_exits_1(tmp_path):
    slo = tmp_path / "tight.yaml"
    slo.write_text("name: tight\npercentiles:\n  - {metric: ttft_ms, percentile: 50, max_ms: 1}\n")
    with MockProcess("--ttft-ms", "30", "--itl-ms", "1") as mock:
        result = bench_run(mock.url, tmp_path / "run", "--output-len", "2", "--num-requests", "30",
                           "--request-rate", "inf", "--slo", str(slo))  # fmt: skip
        ok = bench_run(mock.url, tmp_path / "ok", "--output-len", "2", "--num-requests", "5",
                       "--request-rate", "inf")  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "missed its SLO" in result.stderr
    assert ok.returncode == 0, ok.stderr


def test_ctrl_c_gives_every_scheduled_request_exactly_one_row(tmp_path):
    run = tmp_path / "run"
    with MockProcess("--ttft-ms", "5", "--itl-ms", "50") as mock:
        cmd = [sys.executable, "-m", "harness.cli", "run", "--url", mock.url, *FAST, "--output-len", "100",
               "--num-requests", "40", "--request-rate", "10", "--out", str(run)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (run / "schedule.parquet").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 130
    statuses = one_row_per_scheduled(run)
    assert statuses["cancelled"] >= 1 and statuses["not_sent"] >= 20
    ledger = json.loads((run / "summary.json").read_text())["ledger"]
    assert (ledger["scheduled"], ledger["lost"], ledger["unexpected"]) == (40, 0, 0)


def test_the_ledger_reports_a_target_that_leaks_on_cancel(tmp_path):
    args = ("--ttft-ms", "5", "--itl-ms", "200")
    for flags, leaked in (((), 0), (("--leak-on-cancel",), 1)):
        run = tmp_path / f"run-{leaked}"
        with MockProcess(*args, "--metrics", *flags) as mock:
            result = bench_run(mock.url, run, "--output-len", "50", "--num-requests", "6",
                               "--request-rate", "inf", "--timeout", "0.5")  # fmt: skip
        assert "Traceback" not in result.stderr
        ledger = json.loads((run / "summary.json").read_text())["ledger"]
        assert ledger["leak"]["checked"] is True
        assert ledger["leaked"] == leaked, ledger
        if leaked:
            assert ledger["verdict"] == "failed"
            assert "6 running request(s) left" in " ".join(ledger["leak"]["reasons"])
        else:
            assert ledger["verdict"] == "ok"


@pytest.mark.serial
@pytest.mark.parametrize(("rate", "n", "stops"), [("100", 400, True), ("10", 60, False)])
def test_stop_on_saturation_stops_a_run_whose_queue_only_grows(tmp_path, rate, n, stops):
    """A mock with 2 slots (about 30 requests/s) offered 100 requests/s: TTFT and the requests
    in flight rise together, so --stop-on-saturation stops the run (exit 3, the rest
    not_sent); offered 10 requests/s it keeps up and the run completes."""
    run = tmp_path / "run"
    with MockProcess("--ttft-ms", "20", "--itl-ms", "5", "--max-concurrency", "2") as mock:
        result = bench_run(mock.url, run, "--output-len", "8", "--num-requests", str(n),
                           "--request-rate", rate, "--duration", "60", "--stop-on-saturation")  # fmt: skip
    statuses = one_row_per_scheduled(run)
    if stops:
        assert result.returncode == 3, result.stdout + result.stderr
        assert "The target cannot keep up" in result.stderr
        assert "stopped by --stop-on-saturation" in result.stderr
        assert statuses.get("not_sent", 0) > 0
    else:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "cannot keep up" not in result.stderr and statuses == {"ok": n}
