"""`bench run --memory-budget-mb`: a budget too small for the run's chunk gaps makes its pooled
figures a sketch, which summary.json and the card say, within the stated relative error of
the exact figures computed here from chunks.parquet; the default budget keeps them exact."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import bench
from harness.errors import HarnessError
from reports.build import build_card

TINY_MB = "0.002"  # 2,097 bytes: 43 gaps exactly, and the run below has 8 x 15


def _run(url: str, out, *budget: str):
    return CliRunner().invoke(bench, [
        "run", "--url", url, "--model", "mock", "--workload", "random", "--input-len", "8",
        "--output-len", "16", "--num-requests", "8", "--concurrency", "4",
        "--tokenizer", "tiny-random", "--seed", "0", "--out", str(out), "--quiet", *budget,
    ])  # fmt: skip


def _exact_itl(run) -> np.ndarray:
    """Every gap between consecutive token-bearing chunks of an ok request (ms)."""
    ok = {r["request_id"] for r in pq.read_table(run / "requests.parquet").to_pylist()
          if r["status"] == "ok"}  # fmt: skip
    gaps = []
    for rid in sorted(ok):
        rows = [c for c in pq.read_table(run / "chunks.parquet").to_pylist()
                if c["request_id"] == rid and c["n_tokens"]]  # fmt: skip
        gaps += np.diff([c["t_ns"] for c in rows]).tolist()
    return np.array(gaps) / 1e6


def test_a_tiny_budget_sketches_the_pooled_gaps_within_the_stated_error(mock_server, tmp_path):
    with mock_server("--ttft-ms", "2", "--itl-ms", "1", "--jitter-sigma", "0.6") as url:
        tiny, default = tmp_path / "tiny", tmp_path / "default"
        assert _run(url, tiny, "--memory-budget-mb", TINY_MB).exit_code == 0
        assert _run(url, default).exit_code == 0
    config = json.loads((tiny / "manifest.json").read_text())["config"]
    assert config["memory_budget_mb"] == 0.002
    summary = json.loads((tiny / "summary.json").read_text())
    itl = summary["latency_ms"]["itl"]
    assert (itl["quantiles"], itl["relative_error"]) == ("sketch", 0.01)
    exact = _exact_itl(tiny)
    assert itl["n"] == exact.size == 8 * 15
    assert itl["max"] == exact.max()  # the mean, max and n are exact in a sketch too
    assert abs(itl["mean"] - exact.mean()) <= 1e-12 * exact.mean()
    for q in (50, 90, 95, 99):
        want = float(np.percentile(exact, q))
        assert abs(itl[f"p{q}"] - want) <= 0.01 * want * (1 + 1e-9), q
    conventions = summary["conventions"]
    assert conventions["vllm"]["metrics"]["itl"]["quantiles"] == "sketch"
    assert conventions["aiperf"]["metrics"]["inter_chunk_latency"]["quantiles"] == "sketch"
    assert summary["latency_ms"]["ttft"].get("quantiles") is None  # per request: plain, exact
    card = build_card(tiny)
    assert any("quantile sketch" in note and "ITL" in note for note in card.notes)

    itl = json.loads((default / "summary.json").read_text())["latency_ms"]["itl"]
    exact = _exact_itl(default)
    assert (itl["quantiles"], itl["relative_error"]) == ("exact", 0.0)
    assert [itl[f"p{q}"] for q in (50, 99)] == [float(np.percentile(exact, q)) for q in (50, 99)]
    assert not any("quantile sketch" in note for note in build_card(default).notes)


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_budget_of_nothing_is_refused_in_one_sentence(tmp_path, value):
    result = _run("http://127.0.0.1:9/v1", tmp_path / "run", "--memory-budget-mb", value)
    refused = f"--memory-budget-mb must be greater than zero, got {float(value)!r}."
    assert isinstance(result.exception, HarnessError) and str(result.exception) == refused
    assert not (tmp_path / "run").exists()
