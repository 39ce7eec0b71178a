"""Every way a run can stop early, through `bench run` as a user runs it (with its console card,
not --quiet): the exit code, no traceback, the card printed, `bench report` of what was
recorded, and one row per scheduled request (`not_sent` for those never sent)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cli_runs import bench_run_command

from slo.runrecord import RequestColumn, RequestStatus

pytestmark = pytest.mark.slow

FAST = ["--tokenizer", "tiny-random", "--workload", "random", "--input-len", "16"]
CARD_TITLES = ("Report card", "Outcomes")
TIMEOUT_S = 240


def start_run(url: str, run: Path, *args: str) -> subprocess.Popen:
    cmd = bench_run_command(url, run, *FAST, *args)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until_sending(run: Path, settle_s: float) -> None:
    """Block until the run has written its schedule (it sends right after), then `settle_s`."""
    deadline = time.monotonic() + 120
    while not (run / "schedule.parquet").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(settle_s)


def rows_by_status(run: Path) -> Counter:
    """The statuses of the measured rows, after checking that every scheduled request has
    exactly one row and that the rows without a send time are exactly the `not_sent` ones."""
    scheduled = pq.read_table(run / "schedule.parquet").column(RequestColumn.REQUEST_ID)
    rows = pq.read_table(run / "requests.parquet").to_pydict()
    warmup = run / "warmup.parquet"
    warm_ids = (
        pq.read_table(warmup).to_pydict()[RequestColumn.REQUEST_ID] if warmup.exists() else []
    )
    ids = rows[RequestColumn.REQUEST_ID] + warm_ids
    assert Counter(ids) == Counter(scheduled.to_pylist())
    for status, sent in zip(rows[RequestColumn.STATUS], rows[RequestColumn.T_SENT_NS], strict=True):
        assert (status == RequestStatus.NOT_SENT) == (sent is None), (status, sent)
    return Counter(rows[RequestColumn.STATUS])


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def assert_handled(
    result: subprocess.CompletedProcess, run: Path, tmp_path: Path, exit_code: int
) -> Counter:
    """The run ended with `exit_code`, its card printed and no traceback; `bench report` of the
    run writes the HTML and JSON cards. Returns the rows' statuses."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == exit_code, result.stdout + result.stderr
    assert all(title in result.stdout for title in CARD_TITLES), result.stdout
    statuses = rows_by_status(run)
    report = subprocess.run(
        [sys.executable, "-m", "harness.cli", "report", str(run), "-o", "card.html", "--json",
         "card.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert report.returncode == 0, report.stdout + report.stderr
    assert "Traceback" not in report.stderr
    assert (tmp_path / "card.html").stat().st_size > 0
    card = json.loads((tmp_path / "card.json").read_text())
    assert card["failures"]["total"] == sum(statuses.values())
    assert card["failures"]["not_sent"] == statuses[RequestStatus.NOT_SENT]
    return statuses


@pytest.mark.parametrize(
    ("mock_args", "run_args", "stderr_says"),
    [
        pytest.param(
            ("--error-rate", "1.0"),
            ("--output-len", "8", "--num-requests", "20", "--request-rate", "10",
             "--max-consecutive-errors", "3"),
            "3 requests in a row failed",
            id="max-consecutive-errors",
        ),
        pytest.param(
            ("--error-rate", "1.0"),
            ("--output-len", "8", "--num-requests", "60", "--request-rate", "20",
             "--max-error-rate", "0.5"),
            "--max-error-rate 0.5",
            id="max-error-rate",
        ),
        # One slot serving ~18 requests/s offered 40/s: the queue, and with it TTFT and the
        # requests in flight, only grows.
        pytest.param(
            ("--max-concurrency", "1", "--ttft-ms", "20", "--itl-ms", "5"),
            ("--output-len", "8", "--num-requests", "200", "--request-rate", "40",
             "--stop-on-saturation"),
            "stopped by --stop-on-saturation",
            id="stop-on-saturation",
        ),
    ],
)  # fmt: skip
def test_a_run_stopped_by_its_limits_exits_3_with_a_card(
    tmp_path, mock_server, mock_args, run_args, stderr_says
):
    run = tmp_path / "run"
    with mock_server(*mock_args) as url:
        result = finish(start_run(url, run, *run_args))
    statuses = assert_handled(result, run, tmp_path, exit_code=3)
    assert stderr_says in result.stderr
    assert statuses[RequestStatus.NOT_SENT] > 0


def test_ctrl_c_exits_130_with_a_card(tmp_path, mock_server):
    run = tmp_path / "run"
    with mock_server("--ttft-ms", "5", "--itl-ms", "50") as url:
        proc = start_run(url, run, "--output-len", "100", "--num-requests", "40",
                         "--request-rate", "10")  # fmt: skip
        wait_until_sending(run, settle_s=1.0)
        proc.send_signal(signal.SIGINT)
        result = finish(proc)
    statuses = assert_handled(result, run, tmp_path, exit_code=130)
    assert statuses[RequestStatus.NOT_SENT] > 0


def test_a_target_that_dies_after_the_start_exits_3_with_a_card(tmp_path, mock_server):
    """The target answers the preflight and a few requests, then nobody listens: more than
    half of the requests fail."""
    run = tmp_path / "run"
    with contextlib.ExitStack() as server:
        url = server.enter_context(mock_server("--ttft-ms", "2", "--itl-ms", "2"))
        proc = start_run(url, run, "--output-len", "4", "--num-requests", "40",
                         "--request-rate", "20")  # fmt: skip
        wait_until_sending(run, settle_s=0.3)
        server.close()  # the mock server stops here
        result = finish(proc)
    statuses = assert_handled(result, run, tmp_path, exit_code=3)
    assert statuses[RequestStatus.ERROR] > 20


def test_a_dead_target_url_is_one_sentence(tmp_path):
    """Nothing listens at the URL at all: refused before the run starts (exit 2)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = start_run(f"http://127.0.0.1:{port}/v1", tmp_path / "run", "--num-requests", "4")
    result = finish(proc)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "cannot reach the target" in result.stderr
