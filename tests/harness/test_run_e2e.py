"""`bench run` end to end against the mock server: timing accuracy, run directory, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import bench
from harness.errors import HarnessError
from harness.run.config import RunConfig
from harness.run.orchestrator import run_benchmark

FAST = ["--tokenizer", "tiny-random", "--workload", "random", "--input-len", "8"]


@pytest.mark.serial
def test_measured_ttft_and_itl_match_the_mock(mock_server, tmp_path):
    """Mock at TTFT 50 ms, ITL 10 ms; 20 requests/s Poisson: p50s within 5 and 3 ms (10% and
    30%: wide enough for a loaded CI machine, where the client's own event loop adds a couple
    of ms (52.05 ms once), narrow enough to catch a wrong clock, unit or chunk)."""
    with mock_server("--ttft-ms", "50", "--itl-ms", "10") as url:
        config = RunConfig(url=url, workload="random", input_len=8, output_len=16, num_requests=60,
                           request_rate=20.0, tokenizer="tiny-random", out=tmp_path / "run")  # fmt: skip
        outcome = run_benchmark(config)
    assert outcome.complete
    req = pq.read_table(tmp_path / "run" / "requests.parquet").to_pydict()
    assert req["status"] == ["ok"] * 60
    ttft_ms = (np.array(req["t_first_token_ns"]) - np.array(req["t_sent_ns"])) / 1e6
    assert abs(np.median(ttft_ms) - 50) < 5
    chunks = pq.read_table(tmp_path / "run" / "chunks.parquet").to_pydict()
    gaps = []
    by_request: dict[str, list[int]] = {}
    for rid, t_ns, n in zip(chunks["request_id"], chunks["t_ns"], chunks["n_tokens"], strict=True):
        if n > 0:
            by_request.setdefault(rid, []).append(t_ns)
    for times in by_request.values():
        gaps.extend(np.diff(times) / 1e6)
    assert abs(np.median(gaps) - 10) < 3
    assert abs(outcome.summary.latency_ms.ttft.p50 - np.median(ttft_ms)) < 1e-6
    # Poisson arrivals at 20/s: 60 requests span about 3 s.
    sent_s = (max(req["t_sent_ns"]) - min(req["t_sent_ns"])) / 1e9
    assert 1.5 < sent_s < 6.0


def test_run_directory_contents(mock_server, tmp_path):
    with mock_server("--ttft-ms", "2", "--itl-ms", "1") as url:
        result = CliRunner().invoke(bench, ["run", "--url", url, *FAST, "--output-len", "4", "--num-requests", "10",
                                            "--request-rate", "inf", "--warmup", "2", "--slo", "p99", "--out", str(tmp_path / "r"), "--quiet"])  # fmt: skip
    # 10 samples cannot judge p99 (min_samples 100): inconclusive, exit 3 as the gate's
    assert result.exit_code == 3, result.output
    assert "inconclusive" in result.output.lower()
    run = tmp_path / "r"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["schema_version"] == 1
    assert manifest["target"]["model"] == "mock" and manifest["workload"]["sha256"]
    assert manifest["slo"] is not None
    assert pq.read_table(run / "requests.parquet").num_rows == 10
    assert pq.read_table(run / "warmup.parquet").num_rows == 2
    assert pq.read_table(run / "chunks.parquet").num_rows == 10 * (4 + 1)  # 4 tokens + usage chunk
    summary = json.loads((run / "summary.json").read_text())
    assert summary["counts"]["by_status"]["ok"] == 10


def test_closed_loop_never_exceeds_its_users(mock_server, tmp_path):
    with mock_server("--ttft-ms", "20", "--itl-ms", "5") as url:
        outcome = run_benchmark(RunConfig(url=url, workload="random", input_len=8, output_len=4, num_requests=24,
                                          concurrency=4, tokenizer="tiny-random", out=tmp_path / "run"))  # fmt: skip
    req = pq.read_table(outcome.run_dir / "requests.parquet").to_pydict()
    events = sorted(
        [(t, 1) for t in req["t_sent_ns"]] + [(t, -1) for t in req["t_done_ns"]],
        key=lambda e: (e[0], e[1]),
    )
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert peak == 4
    assert len(req["status"]) == 24


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--workload", "no-such-workload"], "no-such-workload"),
        (["--num-requests", "0"], "--num-requests"),
        (["--request-rate", "-1"], "--request-rate"),
        (["--concurrency", "0"], "--concurrency"),
        (["--timeout", "0"], "--timeout"),
        (["--url", "ftp://x"], "--url"),
        (["--slo", "no-such-slo"], "no-such-slo"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(args, phrase, tmp_path):
    cmd = [sys.executable, "-m", "harness.cli", "run", "--url", "http://127.0.0.1:9/v1", *FAST,
           "--num-requests", "2", *args, "--out", str(tmp_path / "r"), "--quiet"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert phrase in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 3


@pytest.mark.slow
def test_unreachable_url_is_one_sentence(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--url", "http://127.0.0.1:9/v1", *FAST,
                           "--num-requests", "2", "--out", str(tmp_path / "r"), "--quiet"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "cannot reach the target" in proc.stderr and "Traceback" not in proc.stderr


def test_existing_run_is_never_overwritten(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "requests.parquet").write_bytes(b"precious")
    with pytest.raises(HarnessError, match="already holds files"):
        run_benchmark(RunConfig(url="http://127.0.0.1:9/v1", tokenizer="tiny-random", out=run))
    assert (run / "requests.parquet").read_bytes() == b"precious"


def test_unwritable_out(tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits; /proc refuses new directories
        unwritable = Path("/proc/bench-no-such-dir/r")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        unwritable = locked / "r"
    with pytest.raises(HarnessError, match="cannot write the run directory"):
        run_benchmark(
            RunConfig(url="http://127.0.0.1:9/v1", tokenizer="tiny-random", out=unwritable)
        )


@pytest.mark.slow
def test_out_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "afile"
    target.write_text("keep me")
    result = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--url", "http://127.0.0.1:9/v1", *FAST,
                             "--out", str(target), "--quiet"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2 and "is a file" in result.stderr
    assert target.read_text() == "keep me"


def test_ctrl_c_leaves_a_readable_incomplete_run(mock_server, tmp_path):
    run = tmp_path / "r"
    with mock_server("--ttft-ms", "5", "--itl-ms", "50") as url:
        proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", "--url", url, *FAST, "--output-len", "200",
                                 "--num-requests", "40", "--request-rate", "20", "--out", str(run), "--quiet"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while not (run / "manifest.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert str(run) in stderr and "incomplete" in stderr
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is False and "SIGINT" in manifest["interrupted_reason"]
    req = pq.read_table(run / "requests.parquet").to_pydict()
    assert "cancelled" in req["status"]
    assert len(req["status"]) == len(set(req["request_id"]))
    assert json.loads((run / "summary.json").read_text())["counts"]


def test_help_lists_examples():
    result = CliRunner().invoke(bench, ["--help"])
    assert result.exit_code == 0 and "Examples" in result.output and "bench run" in result.output
