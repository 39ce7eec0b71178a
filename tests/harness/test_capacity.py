"""`bench capacity` against a mock that saturates at a known rate finds that rate within 5%."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from harness.cli import bench

# Service time 20 ms + 3 x 10 ms = 50 ms; 4 slots: the mock saturates at 4 / 0.050 = 80 req/s.
# (Long enough that the ~1 ms of HTTP overhead per request moves the knee by ~2% at most.)
CAPACITY_PER_S = 80.0

WORKLOAD = """
name: capacity-probe
description: fixed short requests at constant spacing
num_requests: 160
seed: 0
ignore_eos: true
source:
  kind: synthetic
  input: {dist: fixed, value: 8}
  output: {dist: fixed, value: 4}
arrivals:
  process: constant
  rate: 10
"""

SLO = """
name: e2e-under-load
description: end-to-end latency within 2.4x the service time (50 ms) for 90% of requests
per_request:
  e2e_ms: 120
attainment_min: 0.9
"""


# The search starts at 50/s (one doubling to 100 brackets the knee): probes at 20 and 40/s took
# 8 and 4 s of the serial tier and told the search nothing the 50/s probe does not. A bracket of
# 5% (the assertion's tolerance) ends it after 9 probes (bisection, re-checks, confirmation):
# 2.5% took 13 probes and 33 s of the serial tier, against 24 s.
@pytest.mark.serial
def test_capacity_search_finds_the_saturation_rate(mock_server, tmp_path):
    (tmp_path / "w.yaml").write_text(WORKLOAD)
    (tmp_path / "slo.yaml").write_text(SLO)
    with mock_server(
        "--ttft-ms", "20", "--itl-ms", "10", "--output-len", "4", "--max-concurrency", "4"
    ) as url:
        result = CliRunner().invoke(bench, [
            "capacity", "--url", url, "--workload", str(tmp_path / "w.yaml"), "--slo", str(tmp_path / "slo.yaml"),
            "--tokenizer", "tiny-random", "--start-rate", "50", "--max-iterations", "14", "--rel-width", "0.05",
            "--out", str(tmp_path / "cap"), "--quiet",
        ])  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    found = record["capacity_rate_per_s"]
    assert abs(found - CAPACITY_PER_S) / CAPACITY_PER_S <= 0.05, record["curve"]
    assert record["curve"] and all(
        (tmp_path / "cap" / p["run_dir"] / "summary.json").exists() for p in record["probes"]
    )
