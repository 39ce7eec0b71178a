"""Flags a run must not raise on an honest target, through `bench run`, each beside a case
that must still raise it: usage that disagrees with the stream, a client that could not keep
to its schedule, a token source that differs between requests."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import bench

# Prompts that end in multi-byte characters: tiny-random's random weights then pick byte
# tokens that decode into incomplete UTF-8, which the reference engine holds back (events
# with empty text while the usage so far grows) until the character is whole.
MULTI_BYTE_PROMPTS = [f"{i} 東京 北京 Москва 😀" for i in range(8)]


def _sharegpt(path: Path, prompts: list[str]) -> Path:
    convs = [
        {"id": str(i), "conversations": [{"from": "human", "value": prompt},
                                         {"from": "gpt", "value": "Zürich São Paulo " * 6}]}
        for i, prompt in enumerate(prompts)
    ]  # fmt: skip
    path.write_text(json.dumps(convs, ensure_ascii=False))
    return path


def _bench_run(*args: str) -> str:
    result = CliRunner().invoke(bench, ["run", *args])
    assert result.exit_code == 0, result.output
    return result.output


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_held_back_utf8_is_not_a_usage_mismatch_on_the_reference_engine(tmp_path):
    data = _sharegpt(tmp_path / "multi_byte.json", MULTI_BYTE_PROMPTS)
    run_dir = tmp_path / "run"
    _bench_run("--model", "tiny-random", "--workload", "sharegpt", "--dataset-path", str(data),
               "--ignore-eos", "--num-requests", "8", "--request-rate", "inf",
               "--startup-timeout", "120", "--out", str(run_dir), "--quiet")  # fmt: skip
    requests = pq.read_table(run_dir / "requests.parquet").to_pylist()
    chunks = pq.read_table(run_dir / "chunks.parquet").to_pylist()
    assert [r["status"] for r in requests] == ["ok"] * 8
    # the case under test happened: events without text besides each stream's final usage
    assert sum(c["n_chars"] == 0 for c in chunks) > len(requests)
    assert [r["output_flags"] for r in requests] == [None] * 8
    assert _summary(run_dir)["correctness"] is None  # no request flagged, none compared
    for r in requests:
        assert r["chunk_tokens_source"] == "usage"
        assert r["client_output_tokens"] == r["usage_completion_tokens"] == r["output_tokens"]
    # the tokens of the events without text are counted where they arrived
    assert any(c["n_tokens"] > 0 and c["n_chars"] == 0 for c in chunks)


@pytest.mark.serial
@pytest.mark.slow
def test_waiting_for_a_concurrency_cap_is_not_client_bound(mock_server, tmp_path):
    """Twenty requests due at once through two slots of 50 ms: the later ones queue for
    hundreds of ms behind the cap, which is the load asked for, not a late client."""
    run_dir = tmp_path / "run"
    with mock_server("--ttft-ms", "50", "--itl-ms", "1") as url:
        _bench_run("--url", url, "--tokenizer", "tiny-random", "--input-len", "8",
                   "--output-len", "4", "--request-rate", "inf", "--concurrency", "2",
                   "--num-requests", "20", "--out", str(run_dir), "--quiet")  # fmt: skip
    summary = _summary(run_dir)
    assert summary["latency_ms"]["queue"]["max"] > 300  # 9 waves of about 53 ms
    assert summary["client_bound"] is False
    assert summary["dispatch_lag_ms"]["p99"] < summary["client_bound_threshold_ms"]
    requests = pq.read_table(run_dir / "requests.parquet").to_pylist()
    held = [r for r in requests if r["t_slot_freed_ns"] is not None]
    assert len(held) == 18  # all but the first two waited for a slot
    assert all(r["t_slot_freed_ns"] <= r["t_sent_ns"] for r in held)


MIXED_SOURCES = "Output tokens come from mixed sources"


def _mock_run(mock_server, tmp_path: Path, *mock_args: str) -> tuple[dict, str]:
    run_dir = tmp_path / "run"
    with mock_server("--ttft-ms", "2", "--itl-ms", "1", *mock_args) as url:
        output = _bench_run("--url", url, "--tokenizer", "tiny-random", "--input-len", "8",
                            "--output-len", "4", "--request-rate", "inf",
                            "--num-requests", "10", "--out", str(run_dir))  # fmt: skip
    return _summary(run_dir), output


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["--reject-rate", "--error-rate"])
def test_requests_without_output_do_not_mix_the_token_sources(mock_server, tmp_path, fault):
    summary, output = _mock_run(mock_server, tmp_path, fault, "0.5")
    failed = summary["counts"]["total"] - summary["counts"]["by_status"]["ok"]
    assert 0 < failed < 10  # some requests failed before any output, some did not
    assert summary["output_tokens_source"] == "usage"
    assert summary["output_tokens_source_counts"] == {"usage": 10 - failed}
    assert MIXED_SOURCES not in output


@pytest.mark.slow
def test_requests_cut_after_some_output_still_mix_the_token_sources(mock_server, tmp_path):
    """A stream reset half way has output but no usage: the client counted its tokens, a
    genuine second source beside the usage of the complete ones."""
    summary, output = _mock_run(mock_server, tmp_path, "--reset-rate", "0.5")
    cut = summary["counts"]["by_error_class"]["connection_reset"]  # status unknown
    assert 0 < cut < 10
    assert summary["output_tokens_source"] == "mixed"
    assert summary["output_tokens_source_counts"] == {"tokenizer": cut, "usage": 10 - cut}
    assert MIXED_SOURCES in output
