"""`bench run` against a real P/D cluster (tiny-random, one prefill and one decode worker): every
ok request's record carries the router's `usage.kv_transfer` (bytes on the link > 0, a
transfer, a prefill and an install time, the decode worker that served it), and the card's
effective bandwidth is the records' sum(bytes) / sum(transfer_ms), summed here from
requests.parquet. `bench run`'s default options (usage in every chunk) are prefilled and
decoded apart like any other."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from pd_cluster import running_pd_cluster

from engine_ref.serving.interface import EngineConfig
from engine_ref.serving.server import ServerConfig
from harness.cli import bench

pytestmark = pytest.mark.slow  # starts worker processes

ENGINE = EngineConfig(model="tiny-random", dtype="float32", num_blocks=64, max_num_seqs=4)


def test_bench_run_records_each_handoff_and_the_card_divides_their_sums(tmp_path):
    out, card_json = tmp_path / "run", tmp_path / "card.json"
    with running_pd_cluster(ServerConfig(engine=ENGINE, port=0), prefill=1, decode=1) as url:
        result = CliRunner().invoke(bench, [
            "run", "--url", url, "--model", "tiny-random", "--workload", "random",
            "--input-len", "20", "--output-len", "4", "--num-requests", "4",
            "--request-rate", "inf", "--out", str(out), "--quiet",
        ])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "requests.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok"] * 4
    for r in rows:
        assert r["kv_transfer_bytes"] > 0 and r["kv_transfer_ok"] is True, r
        assert r["kv_transfer_ms"] > 0 and r["kv_prefill_ms"] >= 0
        assert r["served_by"] == "decode-0" and r["kv_transfer_retried"] is None
        assert r["kv_install_ms"] is not None and r["kv_install_ms"] >= 0
    total_bytes = sum(r["kv_transfer_bytes"] for r in rows)
    total_ms = sum(r["kv_transfer_ms"] for r in rows)
    result = CliRunner().invoke(bench, ["report", str(out), "--json", str(card_json)])
    assert result.exit_code == 0, result.output
    block = json.loads(card_json.read_text())["disaggregation"]
    assert (block["requests_with_transfer"], block["transfers_ok"]) == (4, 4)
    assert block["total_transfer_bytes"] == total_bytes
    expected_mb_per_s = total_bytes / 1e6 / (total_ms / 1e3)
    assert block["effective_bandwidth_mb_per_s"] == pytest.approx(expected_mb_per_s, abs=1e-4)
    assert f"Effective link bandwidth: {expected_mb_per_s:,.3f} MB/s" in result.output
