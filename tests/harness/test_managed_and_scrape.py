"""The managed reference server (tiny-random) end to end, and the /metrics scraper."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from test_energy import check_bounds_cost_and_energy

from harness.errors import HarnessError
from harness.run.config import RunConfig
from harness.run.orchestrator import run_benchmark
from harness.targets.managed import ManagedServerConfig, managed_server
from harness.targets.scraper import parse_metrics

EXPOSITION = """# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# HELP vllm:prompt_tokens Prompt tokens.
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 120.0
"""


def test_parse_metrics_keeps_every_sample_with_its_labels():
    rows = parse_metrics(EXPOSITION)
    assert ("vllm:num_requests_running", '{"model_name": "m"}', 3.0) in rows
    assert ("vllm:prompt_tokens_total", '{"model_name": "m"}', 120.0) in rows


@pytest.mark.slow
def test_managed_reference_engine_run(tmp_path):
    config = RunConfig(model="tiny-random", workload="random", input_len=16, output_len=8, num_requests=6,
                       request_rate=float("inf"), out=tmp_path / "run", scrape_interval_s=0.2,
                       startup_timeout_s=120, slo={"name": "patient", "per_request": {"ttft_ms": 60000}},
                       cost_per_hour=3.6)  # fmt: skip
    outcome = run_benchmark(config)
    assert outcome.complete
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["target"]["kind"] == "managed"
    assert manifest["target"]["url"].startswith("http://127.0.0.1:")
    assert manifest["target"]["engine"] == "engine_ref" and manifest["target"]["engine_config"]
    req = pq.read_table(tmp_path / "run" / "requests.parquet").to_pydict()
    assert req["status"] == ["ok"] * 6
    assert req["output_tokens"] == [8] * 6 and set(req["output_tokens_source"]) == {"usage"}
    metrics = pq.read_table(tmp_path / "run" / "server_metrics.parquet").to_pydict()
    assert "vllm:num_requests_running" in set(metrics["name"])
    assert "vllm:kv_memory_block_bytes" in set(metrics["name"])
    # Memory per request: tiny-random's KV geometry (4 layers, 2 KV heads, head_dim 16) and
    # each request's peak blocks, ceil((prompt + 7 written outputs) / block size); the 8th
    # output is sampled and never written.
    g = manifest["target"]["kv_geometry"]
    assert (g["num_layers"], g["num_kv_heads"], g["head_dim"]) == (4, 2, 16)
    assert g["kv_bytes_per_token"] == 2 * 4 * 2 * 16 * g["element_bytes"]
    assert g["pool_bytes"] == g["kv_bytes_per_token"] * g["block_size"] * g["num_blocks"]
    block_bytes = g["kv_bytes_per_token"] * g["block_size"]
    expected = [-(-(p + 7) // g["block_size"]) * block_bytes for p in req["usage_prompt_tokens"]]
    assert req["kv_peak_bytes"] == expected and req["kv_evicted_tokens"] == [0] * 6
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["memory"]["source"] == "reported"
    assert summary["memory"]["kv_peak_bytes"]["max"] == max(expected)
    check_bounds_cost_and_energy(tmp_path / "run", summary, req)


@pytest.mark.slow
def test_managed_server_that_cannot_start_shows_its_log():
    with pytest.raises(HarnessError, match="exited with code") as info:
        with managed_server(ManagedServerConfig(model="no-such-model", startup_timeout_s=60)):
            pass
    assert "no-such-model" in str(info.value)


def test_mock_without_metrics_is_not_scraped(mock_server, tmp_path):
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        run_benchmark(RunConfig(url=url, workload="random", input_len=8, output_len=2, num_requests=3,
                                tokenizer="tiny-random", out=tmp_path / "run", scrape_interval_s=0.1))  # fmt: skip
    assert not (tmp_path / "run" / "server_metrics.parquet").exists()
