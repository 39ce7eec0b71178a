"""`bench run --no-stream`: TTFT, TPOT and ITL are undefined (not 0, not the whole latency)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from click.testing import CliRunner

from harness.cli import bench


def test_non_streaming_run_has_undefined_ttft_tpot_itl(mock_server, tmp_path):
    with mock_server("--ttft-ms", "20", "--itl-ms", "2") as url:
        result = CliRunner().invoke(bench, ["run", "--url", url, "--tokenizer", "tiny-random",
                                            "--input-len", "4", "--output-len", "8",
                                            "--num-requests", "6", "--request-rate", "inf",
                                            "--no-stream", "--out", str(tmp_path / "r"),
                                            "--quiet"])  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    latency = summary["latency_ms"]
    for name in ("ttft", "tpot", "itl"):
        assert latency[name]["n"] == 0 and latency[name]["p50"] is None, name
    assert latency["e2e"]["n"] == 6 and latency["e2e"]["p50"] > 20  # whole response
    assert summary["streamed"] is False and "ttft" in summary["undefined_metrics"]
    rows = pq.read_table(tmp_path / "r" / "requests.parquet").to_pydict()
    assert rows["t_first_token_ns"] == [None] * 6 and rows["t_first_byte_ns"][0] is not None
    assert rows["output_tokens"] == [8] * 6
