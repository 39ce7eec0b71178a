"""`bench run --workers N`: one schedule split across worker processes, through the CLI against
the mock; a worker killed mid-run; the split and `--workers auto` against hand-worked cases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import orjson
import pytest
from cli_runs import bench_run_command

from harness.errors import HarnessError
from harness.http.client import RequestPayload
from harness.load.loadgen import LoadPlan
from harness.load.split import auto_workers, split_plan
from slo.runrecord import (
    ErrorClass,
    RequestColumn,
    RequestStatus,
    ScheduleColumn,
    open_run,
    read_manifest,
)

FAST = ["--tokenizer", "tiny-random", "--workload", "random", "--input-len", "8", "--quiet"]


def _bench_run(url: str, out: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = bench_run_command(url, out, *FAST, *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.serial
@pytest.mark.slow
def test_two_workers_measure_what_one_process_measures(mock_server, tmp_path):
    """Low load (8 requests/s, about 2 in flight): splitting the schedule over two processes
    changes nothing the target does, so the two runs' TTFT and ITL medians agree. The mock's
    lognormal jitter (sigma 0.1) puts the median of 40 TTFT samples within about 2% of the
    truth (1.25 sigma / sqrt(n)); 15% leaves room for the scheduler noise of a shared CPU."""
    with mock_server("--ttft-ms", "40", "--itl-ms", "8", "--jitter-sigma", "0.1") as url:
        args = ("--output-len", "12", "--num-requests", "40", "--request-rate", "8", "--seed", "3")
        one = _bench_run(url, tmp_path / "one", *args, "--workers", "1")
        two = _bench_run(url, tmp_path / "two", *args, "--workers", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    s1, s2 = _summary(tmp_path / "one"), _summary(tmp_path / "two")
    for s in (s1, s2):
        assert s["ledger"]["lost"] == 0 and s["ledger"]["outcomes"]["ok"] == 40
    for metric in ("ttft", "itl"):
        p1, p2 = s1["latency_ms"][metric]["p50"], s2["latency_ms"][metric]["p50"]
        assert abs(p2 - p1) / p1 < 0.15, (metric, p1, p2)
    workers = read_manifest(tmp_path / "two").workers
    assert read_manifest(tmp_path / "one").workers is None  # --workers 1: this process
    assert workers["count"] == 2 and "CLOCK_MONOTONIC" in workers["clock"]
    assert [w["requests"] for w in workers["per_worker"]] == [20, 20]
    assert all(w["dispatch_lag_ms"]["n"] == 20 for w in workers["per_worker"])
    # Both runs schedule the same hash-pinned requests.
    sched = [open_run(tmp_path / d).schedule[ScheduleColumn.REQUEST_ID].to_pylist() for d in ("one", "two")]  # fmt: skip
    assert sched[0] == sched[1]


@pytest.mark.serial
@pytest.mark.slow
def test_each_workers_dispatch_lag_leaves_out_the_caps_queueing(mock_server, tmp_path):
    """All 20 requests at once under a cap of 2 (one slot per worker), each about 55 ms: most
    wait hundreds of ms for a slot. That wait is the load asked for, so the manifest's lag per
    worker, like the summary's, runs from when the slot was freed (it was the whole wait)."""
    with mock_server("--ttft-ms", "50", "--itl-ms", "1") as url:
        proc = _bench_run(url, tmp_path / "r", "--output-len", "4", "--num-requests", "20",
                          "--request-rate", "inf", "--concurrency", "2", "--workers", "2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(tmp_path / "r")
    assert summary["latency_ms"]["queue"]["max"] > 300  # 9 or 10 waits of about 55 ms
    per_worker = read_manifest(tmp_path / "r").workers["per_worker"]
    assert [w["dispatch_lag_ms"]["n"] for w in per_worker] == [10, 10]
    assert all(w["dispatch_lag_ms"]["max"] < 50 for w in per_worker), per_worker
    assert summary["client_bound"] is False


@pytest.mark.slow
def test_workers_outpacing_this_process_wait_for_it_instead_of_dying(mock_server, tmp_path):
    """Two workers streaming as fast as the mock can send (no delays), with results far
    bigger than a pipe holds: when this process reads the pipes more slowly than the workers
    fill them, a worker's send must wait. (uvloop leaves a pipe it watches non-blocking; a
    full one then raised BlockingIOError in the worker, which died and lost its requests.)"""
    with mock_server("--ttft-ms", "0", "--itl-ms", "0") as url:
        proc = _bench_run(url, tmp_path / "r", "--output-len", "1024", "--num-requests", "600",
                          "--concurrency", "64", "--workers", "2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    summary = _summary(tmp_path / "r")
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["outcomes"]["ok"] == 600


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "many"])  # more in the config test below
def test_bad_workers_is_one_sentence(value, tmp_path):
    proc = _bench_run(
        "http://127.0.0.1:9/v1", tmp_path / "r", "--num-requests", "2", "--workers", value
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "--workers" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_faults_with_workers_is_one_sentence(mock_server, tmp_path):
    with mock_server() as url:
        proc = _bench_run(url, tmp_path / "r", "--num-requests", "2", "--workers", "2",
                          "--faults", "latency-200ms")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--faults and --workers" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_requests", "workers", "warmup", "used"),
    [
        (1, 2, 0, 1),  # 1 request
        (3, 8, 4, 3),  # more workers than requests, with warm-up
        (3, "auto", 0, min(3, max(1, (os.cpu_count() or 1) - 1))),  # all at once: cores - 1
    ],
)
def test_small_runs_use_only_the_workers_they_can(mock_server, tmp_path, num_requests, workers, warmup, used):  # fmt: skip
    with mock_server("--ttft-ms", "2", "--itl-ms", "1") as url:
        proc = _bench_run(url, tmp_path / "r", "--output-len", "4", "--request-rate", "inf",
                          "--num-requests", str(num_requests), "--workers", str(workers),
                          "--warmup", str(warmup))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    tables = open_run(tmp_path / "r")
    assert tables.requests[RequestColumn.STATUS].to_pylist() == ["ok"] * num_requests
    assert tables.warmup.num_rows == warmup
    section = tables.manifest.workers
    assert section["count"] == used and len(section["per_worker"]) == used
    assert sum(w["requests"] for w in section["per_worker"]) == num_requests
    assert sum(w["warmup"] for w in section["per_worker"]) == warmup
    if workers == "auto":
        assert section["requested"] == "auto" and "tokens/s" in section["why"]
    else:
        assert (f"{used} used" in section["why"]) == (used < workers)
    from reports.build import build_card

    rows = build_card(tmp_path / "r").client_health.workers  # the card shows each worker
    assert [(w["worker"], w["requests"], w["died"]) for w in rows] == [
        (w["worker"], w["requests"], False) for w in section["per_worker"]
    ]
    assert all(w["dispatch_lag_p50_ms"] is not None and w["clock_offset_ms"] is None for w in rows)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "per_worker"),
    [
        # 9 requests, 3 users on 2 workers: users 0 and 2 (requests i mod 3 in {0, 2}) on worker 0.
        (
            (
                "--workload",
                "random",
                "--input-len",
                "8",
                "--num-requests",
                "9",
                "--concurrency",
                "3",
            ),
            [6, 3],
        ),  # fmt: skip
        (("--workload", "multi-turn", "--num-requests", "6"), None),  # whole sessions per worker
    ],
)
def test_closed_loop_and_sessions_split_across_workers(mock_server, tmp_path, args, per_worker):
    with mock_server("--ttft-ms", "2", "--itl-ms", "1") as url:
        cmd = [sys.executable, "-m", "harness.cli", "run", "--url", url, "--tokenizer", "tiny-random",
               "--output-len", "4", "--quiet", *args, "--workers", "2", "--out", str(tmp_path / "r")]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    tables = open_run(tmp_path / "r")
    statuses = tables.requests[RequestColumn.STATUS].to_pylist()
    assert set(statuses) == {RequestStatus.OK} and _summary(tmp_path / "r")["ledger"]["lost"] == 0
    counts = [w["requests"] for w in tables.manifest.workers["per_worker"]]
    assert sum(counts) == len(statuses)
    if per_worker is not None:
        assert counts == per_worker
    else:  # whole sessions: session j (in schedule order) on worker j mod 2, all its turns
        session_of = dict(zip(tables.requests[RequestColumn.REQUEST_ID].to_pylist(),
                              tables.requests[RequestColumn.SESSION_ID].to_pylist(), strict=True))  # fmt: skip
        order = list(dict.fromkeys(session_of[r] for r in tables.schedule[ScheduleColumn.REQUEST_ID].to_pylist()))  # fmt: skip
        sizes = Counter(session_of.values())
        expected = [sum(sizes[sid] for j, sid in enumerate(order) if j % 2 == k) for k in (0, 1)]
        assert len(order) >= 2 and counts == expected


def _payloads(n: int, max_tokens: int = 10) -> list[RequestPayload]:
    return [RequestPayload(f"r{i}", orjson.dumps({"max_tokens": max_tokens})) for i in range(n)]


def test_split_open_loop_thins_the_schedule_round_robin():
    plan = LoadPlan(_payloads(5), [0.0, 0.1, 0.2, 0.3, 0.4], concurrency=3, warmup=_payloads(3))
    parts = split_plan(plan, 2)
    assert [[p.request_id for p in part.payloads] for part in parts] == [["r0", "r2", "r4"], ["r1", "r3"]]  # fmt: skip
    assert [list(part.arrival_s) for part in parts] == [[0.0, 0.2, 0.4], [0.1, 0.3]]
    assert [part.concurrency for part in parts] == [2, 1]  # the cap of 3, split
    assert [len(part.warmup) for part in parts] == [2, 1]


def test_split_closed_loop_follows_the_users():
    # 3 users on 2 workers: users 0 and 2 on worker 0, user 1 on worker 1; request i belongs
    # to user i mod 3, so worker 0 gets r0 r2 r3 r5, worker 1 r1 r4.
    parts = split_plan(LoadPlan(_payloads(6), None, concurrency=3), 2)
    assert [[p.request_id for p in part.payloads] for part in parts] == [["r0", "r2", "r3", "r5"], ["r1", "r4"]]  # fmt: skip
    assert [part.concurrency for part in parts] == [2, 1]
    assert len(split_plan(LoadPlan(_payloads(6), None, concurrency=1), 4)) == 1  # one user


@pytest.mark.parametrize(
    ("arrivals", "max_tokens", "users", "cores", "expected"),
    [
        # 100 requests over 1 s x 12,000 tokens = 1.2M tokens/s: 2 workers of 600k.
        ([i / 99 for i in range(100)], 12_000, None, 8, 2),
        ([i / 99 for i in range(100)], 12_001, None, 8, 3),  # just above 1.2M: 3
        ([i / 99 for i in range(100)], 6000, None, 8, 1),  # 600k: exactly one worker's worth
        ([i / 99 for i in range(100)], 100, None, 8, 1),  # 10k tokens/s: 1
        ([0.0] * 100, 100, None, 8, 7),  # all at once (inf rate): cores - 1
        ([i / 99 for i in range(100)], 60_000, None, 4, 3),  # 20 wanted, at most cores - 1
        ([i / 99 for i in range(100)], 60_000, None, 1, 1),  # one core: one worker
        (None, 10, 64, 8, 1),  # closed loop: 64 users per worker
        (None, 10, 65, 8, 2),
        (None, 10, 1000, 8, 7),
    ],
)
def test_auto_workers(arrivals, max_tokens, users, cores, expected):
    plan = LoadPlan(_payloads(100, max_tokens), arrivals, concurrency=users)
    count, why = auto_workers(plan, cores=cores)
    assert count == expected, why
    assert f"{count}" in why and str(cores) in why


def _worker_pids(parent_pid: int) -> list[int]:
    """The spawned worker processes of `parent_pid` (children running multiprocessing's spawn_main)."""
    pids = []
    for task in Path(f"/proc/{parent_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                pids.append(int(child))
    return sorted(pids)


def _requests_seen(url: str) -> int:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/stats", timeout=5) as resp:
        return json.load(resp)["requests_seen"]


def _run_and_kill_a_worker(mock_server, tmp_path, policy: str):
    """12 requests at 5/s (a 2.4 s schedule) of about 1.5 s each on 2 workers; worker 0 is
    SIGKILLed once the mock has seen 4 requests, so it has some in flight and some unsent."""
    with mock_server("--ttft-ms", "50", "--itl-ms", "50") as url:
        cmd = [sys.executable, "-m", "harness.cli", "run", "--url", url, *FAST, "--output-len", "30",
               "--num-requests", "12", "--request-rate", "5", "--burstiness", "1000", "--workers", "2",
               "--on-worker-failure", policy, "--out", str(tmp_path / "r")]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _requests_seen(url) < 4:
                time.sleep(0.05)
            pids = _worker_pids(proc.pid)
            assert len(pids) == 2, pids
            os.kill(pids[0], signal.SIGKILL)  # the first spawned: worker 0
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return proc.returncode, err


@pytest.mark.slow
def test_ctrl_c_stops_every_worker_and_keeps_the_ledger(mock_server, tmp_path):
    with mock_server("--ttft-ms", "50", "--itl-ms", "50") as url:
        cmd = [sys.executable, "-m", "harness.cli", "run", "--url", url, *FAST, "--output-len", "30",
               "--num-requests", "20", "--request-rate", "5", "--workers", "2", "--out", str(tmp_path / "r")]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _requests_seen(url) < 4:
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    tables = open_run(tmp_path / "r")
    ids = tables.requests[RequestColumn.REQUEST_ID].to_pylist()
    assert sorted(ids) == sorted(tables.schedule[ScheduleColumn.REQUEST_ID].to_pylist())
    outcomes = Counter(tables.requests[RequestColumn.STATUS].to_pylist())
    assert outcomes[RequestStatus.CANCELLED] >= 1 and outcomes[RequestStatus.NOT_SENT] >= 1, (
        outcomes
    )
    assert RequestStatus.UNKNOWN not in outcomes  # no worker died: nothing is unknown
    assert _summary(tmp_path / "r")["ledger"]["lost"] == 0
    assert tables.manifest.interrupted_reason == "interrupted by SIGINT"


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_killed_worker_leaves_every_request_accounted_for(mock_server, tmp_path, policy):
    code, err = _run_and_kill_a_worker(mock_server, tmp_path, policy)
    assert "Traceback" not in err and "worker 0 died (signal 9)" in err, err
    assert code != 0
    tables = open_run(tmp_path / "r")
    scheduled = [rid for rid, warm in zip(tables.schedule[ScheduleColumn.REQUEST_ID].to_pylist(),
                                          tables.schedule[ScheduleColumn.IS_WARMUP].to_pylist(), strict=True) if not warm]  # fmt: skip
    ids = tables.requests[RequestColumn.REQUEST_ID].to_pylist()
    assert Counter(ids) == Counter(scheduled)  # each request of the schedule exactly once
    status = dict(zip(ids, tables.requests[RequestColumn.STATUS].to_pylist(), strict=True))
    error_class = dict(zip(ids, tables.requests[RequestColumn.ERROR_CLASS].to_pylist(), strict=True))  # fmt: skip
    worker0 = [rid for i, rid in enumerate(scheduled) if i % 2 == 0]  # the assignment rule
    worker1 = [rid for i, rid in enumerate(scheduled) if i % 2 == 1]
    lost = Counter(status[r] for r in worker0)
    assert set(lost) <= {RequestStatus.OK, RequestStatus.UNKNOWN, RequestStatus.NOT_SENT}, lost
    assert lost[RequestStatus.UNKNOWN] >= 1 and lost[RequestStatus.NOT_SENT] >= 1, lost
    assert all(error_class[r] == ErrorClass.WORKER_LOST for r in worker0 if status[r] == RequestStatus.UNKNOWN)  # fmt: skip
    others = Counter(status[r] for r in worker1)
    if policy == "continue":
        assert others == {RequestStatus.OK: 6}, others  # the survivor ran its share to the end
    else:
        assert others[RequestStatus.OK] < 6, others  # stopped: cancelled in flight, rest unsent
        assert set(others) <= {RequestStatus.OK, RequestStatus.CANCELLED, RequestStatus.NOT_SENT}
    summary = _summary(tmp_path / "r")
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["unexpected"] == 0
    manifest = tables.manifest
    assert manifest.complete is False and "worker 0 died" in manifest.interrupted_reason
    assert [w["died"] for w in manifest.workers["per_worker"]] == [True, False]


def test_workers_config_boundaries():
    from harness.run.config import RunConfig

    assert RunConfig(workers="AUTO").load.workers == "auto"
    assert RunConfig(workers="3").load.workers == 3 and RunConfig(workers=1).load.workers == 1
    for bad in (0, -2, True, 2.5, "2.5", "", " "):
        with pytest.raises(HarnessError, match="--workers"):
            RunConfig(workers=bad)
    with pytest.raises(HarnessError, match="--on-worker-failure"):
        RunConfig(on_worker_failure="retry")
