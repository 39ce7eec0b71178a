"""`bench run --faults` end to end: the proxy, client faults and engine faults wired into a real
run, the windows they applied in the manifest, the recovery figures and the ledger."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from proc_tree import ServerSampler
from test_run_outcome import MockProcess, one_row_per_scheduled

from slo.runrecord import ChunkColumn, RequestColumn, float_column, open_run

pytestmark = pytest.mark.slow

FAST = ["--tokenizer", "tiny-random", "--workload", "random", "--input-len", "8", "--quiet"]


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "harness.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.serial
def test_latency_plan_adds_its_latency_to_ttft(tmp_path):
    plan = tmp_path / "lat.yaml"
    plan.write_text("name: lat\nwindows:\n  - kind: latency\n    params: {latency_ms: 200}\n")
    ttft = {}
    with MockProcess("--ttft-ms", "10", "--itl-ms", "2") as mock:
        for name, extra in (("direct", ()), ("proxied", ("--faults", str(plan)))):
            run = tmp_path / name
            result = bench("run", "--url", mock.url, *FAST, "--output-len", "4",
                           "--num-requests", "20", "--request-rate", "20", "--out", str(run), *extra)  # fmt: skip
            assert result.returncode == 0, result.stderr
            ttft[name] = _summary(run)["latency_ms"]["ttft"]["p50"]
    added = ttft["proxied"] - ttft["direct"]
    assert 150 < added < 400, ttft
    manifest = json.loads((tmp_path / "proxied" / "manifest.json").read_text())
    faults = manifest["fault_plan"]
    assert faults["name"] == "lat" and len(faults["sha256"]) == 64
    assert faults["windows"][0]["kind"] == "latency" and faults["windows"][0]["start_s"] < 0.1


@pytest.mark.serial
def test_down_window_is_refused_then_recovers(tmp_path):
    plan = tmp_path / "down.yaml"
    plan.write_text("name: down\nwindows:\n  - kind: down\n    at: 1s\n    for: 1s\n")
    run = tmp_path / "run"
    with MockProcess("--ttft-ms", "5", "--itl-ms", "2") as mock:
        result = bench("run", "--url", mock.url, *FAST, "--output-len", "4", "--num-requests", "80",
                       "--request-rate", "20", "--out", str(run), "--faults", str(plan))  # fmt: skip
    assert result.returncode == 0, result.stderr  # a quarter failed: measured, not a broken run
    statuses = one_row_per_scheduled(run)
    assert statuses["ok"] > 40
    rows = pq.read_table(run / "requests.parquet").to_pydict()
    assert "connection_refused" in rows["error_class"] or "connection_reset" in rows["error_class"]
    window = _summary(run)["faults"]["windows"][0]
    assert window["kind"] == "down" and 0.9 < window["start_s"] < 1.3
    assert window["goodput_before_per_s"] > 5 and window["recovery_s"] is not None
    assert window["attainment_in_window"] < 0.5
    assert (
        _summary(run)["ledger"]["verdict"] in ("ok", "unchecked")
        or _summary(run)["ledger"]["lost"] == 0
    )


@pytest.mark.parametrize(("plan_text", "server_args"), [
    ("name: kill\nwindows:\n  - kind: kill_engine\n    at: 2s\n", ()),
    ("name: pause\nwindows:\n  - kind: pause_engine\n    at: 2s\n    for: 1.5s\n",
     ("--server-arg=--engine-loop", "--server-arg=process")),
], ids=["kill", "pause"])  # fmt: skip
def test_engine_faults_on_the_managed_reference_engine(tmp_path, plan_text, server_args):
    """The pause runs the engine in a child of the HTTP process (`--engine-loop process`), the
    case where a SIGSTOP to the HTTP process alone froze the streams while the engine child
    kept stepping: every process of the server must stop for the window, as /proc shows."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_text)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "harness.cli", "run", "--model", "tiny-random", "--workload",
           "random", "--input-len", "16", "--output-len", "32", "--num-requests", "32",
           "--request-rate", "6", "--timeout", "60", "--quiet", "--out", str(run), "--faults",
           str(plan), *server_args]  # fmt: skip
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        sampler = ServerSampler(proc)
        _, stderr = proc.communicate(timeout=300)
    sampler.join()
    assert "Traceback" not in stderr, stderr
    statuses = one_row_per_scheduled(run)
    summary = _summary(run)
    ledger = summary["ledger"]
    assert (ledger["lost"], ledger["unexpected"]) == (0, 0), ledger
    assert ledger["leak"]["checked"] and not ledger["leak"]["leaked"], ledger["leak"]
    window = summary["faults"]["windows"][0]
    manifest = json.loads((run / "manifest.json").read_text())
    if "kill" in plan_text:
        assert manifest["fault_plan"]["engine_restarts"] == 1
        assert window["end_s"] - window["start_s"] < 60  # the outage ends when it answers again
        assert statuses["ok"] >= 1 and sum(statuses.values()) == 32
        assert statuses["ok"] < 32  # the kill cost requests
    else:
        assert statuses["ok"] >= 26  # a pause delays, it does not kill
        _assert_the_pause_stopped_every_stream(run, manifest)
        sampler.assert_one_stop_of_every_process(min_s=1.0)
    # Reported: seconds to get back to 90% of the goodput before, or None (never, in this run).
    assert "recovery_s" in window and window["goodput_before_per_s"] is not None, window


# The engine is stopped a scheduler poll and a task switch after the window opens, and the
# client still reads what the engine had written before: chunks may land this long after start.
PAUSE_SETTLE_S = 0.15


def _assert_the_pause_stopped_every_stream(run: Path, manifest: dict) -> None:
    """The pause was applied (no error recorded) and it stopped the engine: requests were sent
    during the window, yet no chunk of any stream arrived in it, so the chunk-free stretch of
    all streams together spans the window. A no-op pause fails here (requests sent in the
    window would be answered in it)."""
    windows = manifest["fault_plan"]["windows"]
    assert [w["error"] for w in windows if "error" in w] == [], windows
    (window,) = windows
    start_s, end_s = window["start_s"], window["end_s"]
    paused_s = end_s - start_s
    assert 1.4 < paused_s < 2.0, window  # the plan's 1.5 s, to a few scheduler polls

    tables = open_run(run)
    sent_s = float_column(tables.requests, RequestColumn.T_SENT_NS) / 1e9
    assert np.any((sent_s > start_s + PAUSE_SETTLE_S) & (sent_s < end_s - PAUSE_SETTLE_S)), (
        f"no request was sent during the pause window {start_s:.2f}-{end_s:.2f} s"
    )
    chunk_s = np.sort(float_column(tables.chunks, ChunkColumn.T_NS) / 1e9)
    in_window = chunk_s[(chunk_s > start_s + PAUSE_SETTLE_S) & (chunk_s < end_s)]
    assert in_window.size == 0, f"{in_window.size} chunks arrived while paused: {in_window[:5]}"
    last_before = chunk_s[chunk_s <= start_s + PAUSE_SETTLE_S].max()
    first_after = chunk_s[chunk_s >= end_s].min()
    assert first_after - last_before >= paused_s - PAUSE_SETTLE_S, (last_before, first_after)


def test_fifty_cancelled_streams_leave_the_reference_engine_idle(tmp_path):
    """A client that cancels 50 streams after 4 tokens: the ledger reads the engine's live KV
    blocks back at their idle level afterwards (no leak), and every request is accounted for."""
    plan = tmp_path / "cancel.yaml"
    plan.write_text("name: cancel-all\nwindows:\n  - kind: cancel\n    params: {after_tokens: 4}\n")
    run = tmp_path / "run"
    result = bench("run", "--model", "tiny-random", "--workload", "random", "--input-len", "64",
                   "--output-len", "256", "--num-requests", "50", "--request-rate", "inf",
                   "--max-error-rate", "0.1", "--out", str(run), "--faults", str(plan))  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr
    # Cancellations are the client's own doing: neither --max-error-rate nor the "most
    # requests failed" rule counts them, so the run completed and exits 0.
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stopped early" not in result.stdout and "did not serve" not in result.stdout
    statuses = one_row_per_scheduled(run)
    assert statuses["cancelled"] == 50
    ledger = _summary(run)["ledger"]
    assert ledger["verdict"] == "ok", ledger
    assert ledger["leak"]["after"]["kv_blocks_used"] == ledger["leak"]["before"]["kv_blocks_used"]
    assert ledger["leak"]["after"]["running"] == 0


def test_slow_steps_window_slows_every_step_of_the_managed_engine(tmp_path):
    """A slow_steps window open for the whole run: the managed engine is started with its
    fault-injection route, every step sleeps 120 ms, so no two chunks of a stream come closer
    than that (a lower bound: the sleep guarantees it, however fast the machine)."""
    plan = tmp_path / "slow.yaml"
    plan.write_text("name: slow\nwindows:\n  - kind: slow_steps\n    params: {delay_ms: 120}\n")
    run = tmp_path / "run"
    result = bench("run", "--model", "tiny-random", "--workload", "random", "--input-len", "16",
                   "--output-len", "6", "--num-requests", "6", "--concurrency", "2",
                   "--quiet", "--out", str(run), "--faults", str(plan))  # fmt: skip
    assert result.returncode == 0, result.stderr
    window = json.loads((run / "manifest.json").read_text())["fault_plan"]["windows"][0]
    assert window["kind"] == "slow_steps" and "error" not in window, window
    chunks = pq.read_table(run / "chunks.parquet").to_pydict()
    stamps: dict[str, list[int]] = {}
    for rid, t_ns, n in zip(chunks["request_id"], chunks["t_ns"], chunks["n_tokens"], strict=True):
        if n > 0:  # token events; a usage-only event arrives with the last token's read
            stamps.setdefault(rid, []).append(t_ns)
    gaps_ms = [(b - a) / 1e6 for ts in stamps.values() for a, b in itertools.pairwise(sorted(ts))]
    assert len(gaps_ms) == 6 * 5 and min(gaps_ms) >= 110, sorted(gaps_ms)[:5]
    assert one_row_per_scheduled(run) == {"ok": 6}


def test_shrunken_kv_plan_forces_preemption_and_still_finishes_everything(tmp_path):
    """engine_args start the managed engine with 16 blocks (256 tokens): eight concurrent
    requests of 64 + 64 tokens cannot all fit, so the scheduler preempts; all still end ok,
    and the blocks return to idle."""
    plan = tmp_path / "kv.yaml"
    plan.write_text('name: small-kv\nengine_args: [--num-blocks, "16"]\n')
    run = tmp_path / "run"
    result = bench("run", "--model", "tiny-random", "--workload", "random", "--input-len", "64",
                   "--output-len", "64", "--num-requests", "16", "--concurrency", "8",
                   "--ignore-eos", "--quiet", "--out", str(run), "--faults", str(plan))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert one_row_per_scheduled(run) == {"ok": 16}
    metrics = pq.read_table(run / "server_metrics.parquet").to_pydict()
    samples: dict[str, list[float]] = {}
    for name, value in zip(metrics["name"], metrics["value"], strict=True):
        samples.setdefault(name, []).append(value)
    pool = {a + b for a, b in zip(samples["vllm:kv_cache_blocks_used"],
                                  samples["vllm:kv_cache_blocks_free"], strict=True)}  # fmt: skip
    assert pool == {16}, pool  # the pool really shrank
    assert max(samples["vllm:num_preemptions_total"]) > 0
    ledger = _summary(run)["ledger"]
    assert ledger["verdict"] == "ok" and not ledger["leak"]["leaked"], ledger
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["fault_plan"]["plan"]["engine_args"] == ["--num-blocks", "16"]
