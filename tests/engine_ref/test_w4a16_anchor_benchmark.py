"""benchmarks/w4a16_vs_llamacpp.py end to end on tiny-random: two reference-engine configs
through `bench run`, one round, and the figures it reads back from the run directories."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("w4a16_vs_llamacpp")


@pytest.mark.slow  # starts two managed servers (~40 s on a 2-core box)
def test_one_round_of_two_reference_configs(bench, tmp_path, capsys):
    out = tmp_path / "report.json"
    args = ["--configs", "ref-w4a16,ref-w4a16-torch", "--model", "tiny-random", "--rounds", "1",
            "--num-requests", "4", "--input-len", "8", "--output-len", "6", "--threads", "1",
            "--out", str(tmp_path / "runs"), "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    for config in ("ref-w4a16", "ref-w4a16-torch"):
        (row,) = report["runs"][config]
        assert row["ok"] == 4
        assert 0 < row["tpot_first3_ms"] and 0 < row["tpot_p50_ms"]
        # 0 is an honest ITL: a fast engine's tokens can arrive in one socket read on a busy
        # machine (tiny-random at 0.7 ms a token did in one CI run), and share its time
        assert row["itl_p50_ms"] is not None and row["itl_p50_ms"] >= 0
        assert row["server_rss_max_mb"] >= row["server_rss_median_mb"] > 50  # torch loaded
        manifest = json.loads((tmp_path / "runs" / f"{config}-r1" / "manifest.json").read_text())
        assert manifest["target"]["engine_config"]["quantization"] == "w4a16"
    assert "| ref-w4a16 |" in capsys.readouterr().out


def test_llamacpp_needs_its_python(bench):
    with pytest.raises(SystemExit):
        bench.main(["--configs", "llamacpp"])
