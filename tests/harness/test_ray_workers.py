"""`bench run --ray ADDRESS`: worker shares as Ray actors on a local two-node cluster (skipped
without Ray), the clock-offset estimate against hand-worked cases, and the missing-extra sentence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.http.client import RawResult
from harness.load.ray_workers import clock_offset, shift_raw
from slo.runrecord import RequestColumn, open_run

FAST = ["--tokenizer", "tiny-random", "--workload", "random", "--input-len", "8", "--quiet"]
NO_RAY = "Ray is not installed (pip install 'llm-bench-harness[ray]'); CI installs the extra"


@pytest.mark.parametrize(
    ("samples", "offset", "uncertainty"),
    [
        # The remote clock reads 1,000 + 50 at the midpoint of a 100 ns round trip: offset 1,000.
        ([(0, 1050, 100)], 1000, 50),
        # The smallest round trip (20 ns, the second) decides, not the first or the mean.
        ([(0, 1050, 100), (200, 1210, 220), (300, 1400, 380)], 1000, 10),
        ([(10, 5, 13)], -6, 2),  # a remote clock behind; an odd round trip rounds up
        ([(7, 7, 7)], 0, 0),  # same clock, no delay
    ],
)
def test_clock_offset_takes_the_smallest_round_trip(samples, offset, uncertainty):
    assert clock_offset(samples) == (offset, uncertainty)


def test_clock_offset_needs_a_sample():
    with pytest.raises(ValueError):
        clock_offset([])


def test_shift_raw_moves_every_time_and_keeps_missing_ones():
    raw = RawResult("r", False, 100, t_sent_ns=110, t_first_byte_ns=None, t_done_ns=150)
    raw.reads = [(120, b"a"), (140, b"b")]
    shifted = shift_raw(raw, -100)
    assert (shifted.t_scheduled_ns, shifted.t_sent_ns, shifted.t_first_byte_ns, shifted.t_done_ns) == (0, 10, None, 50)  # fmt: skip
    assert shifted.reads == [(20, b"a"), (40, b"b")]


def test_ray_missing_is_one_sentence(tmp_path):
    """Without Ray, `--ray` ends in one sentence naming the extra (a stub `ray` package that
    fails to import stands in for a machine without it)."""
    stub = tmp_path / "stub" / "ray"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, "-m", "harness.cli", "run", "--url", "http://127.0.0.1:9/v1", *FAST,
           "--num-requests", "2", "--ray", "local", "--out", str(tmp_path / "r")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'llm-bench-harness[ray]'" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.fixture
def two_node_cluster(monkeypatch):
    """A Ray cluster on loopback: a head node and one more, one CPU each. Ray replaces
    127.0.0.1 with the host's network address unless its Windows/macOS switch is off, which
    makes every node, and the `bench` driver started with this environment, use loopback."""
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    pytest.importorskip("ray", reason=NO_RAY)
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    if ray_constants.ENABLE_RAY_CLUSTER:
        pytest.skip("Ray was imported before loopback could be chosen; run this test alone")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=1)
        assert cluster.address.startswith("127.0.0.1:"), cluster.address
        yield cluster
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_ray_actors_on_two_nodes(mock_server, two_node_cluster, tmp_path):
    with mock_server("--ttft-ms", "20", "--itl-ms", "5") as url:
        cmd = [sys.executable, "-m", "harness.cli", "run", "--url", url, *FAST, "--output-len", "6",
               "--num-requests", "12", "--request-rate", "20", "--warmup", "2", "--ray",
               two_node_cluster.address, "--out", str(tmp_path / "r")]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables = open_run(tmp_path / "r")
    assert tables.requests[RequestColumn.STATUS].to_pylist() == ["ok"] * 12
    assert tables.warmup.num_rows == 2
    section = tables.manifest.workers
    assert section["mode"] == "ray" and section["count"] == 2  # one actor per node by default
    nodes = [w["node"] for w in section["per_worker"]]
    assert len(set(nodes)) == 2, nodes  # spread: one actor on each node
    for w in section["per_worker"]:
        # Both nodes share this host's monotonic clock, so the true offset is 0 and the
        # estimate must lie within its own uncertainty (half the smallest round trip).
        assert 0 < w["clock_uncertainty_ns"] < 1e9
        assert abs(w["clock_offset_ns"]) <= w["clock_uncertainty_ns"]
        assert w["dispatch_lag_ms"]["n"] == 6
    # Shifted onto the parent's timeline: every request was sent after the shared start.
    sent = tables.requests[RequestColumn.T_SENT_NS].to_pylist()
    assert min(sent) >= 0
    summary = (Path(tmp_path / "r") / "summary.json").read_text()
    assert '"lost": 0' in summary
