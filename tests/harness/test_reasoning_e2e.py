"""Reasoning end to end (issue 29): `bench run` against the managed reference engine
(tiny-random) with `--reasoning-parser think`. tiny-random writes random tokens, so the
workload's regex constraint (the engine's grammar path) forces `<think>...</think>answer`
text; the engine streams the span as `reasoning_content`, the harness records both parts.

On every request the first answer token comes after the first reasoning token, and the
reasoning and answer tokens add up to the server's `completion_tokens` (each chunk counted by
the usage so far, `--chunk-usage` being the managed engine's default) and the reasoning ones to
its `completion_tokens_details.reasoning_tokens`. Without the parser the same text arrives
inline in `content`: the harness splits the tags itself, and the server reports no count."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from harness.cli.main import bench

pytestmark = pytest.mark.slow

REGEX = "<think>[a-z]{12,16}</think>[a-z]{4,8}"


def _workload(tmp_path) -> str:
    spec = {
        "name": "reasoning",
        "num_requests": 4,
        "ignore_eos": False,
        "source": {
            "kind": "synthetic",
            "input": {"dist": "fixed", "value": 8},
            "output": {"dist": "fixed", "value": 64},
        },
        "constraint": {"regex": REGEX},
    }
    path = tmp_path / "reasoning.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def _run(tmp_path, *server_args: str) -> tuple[list[dict], dict, list[dict]]:
    out = tmp_path / "run"
    args = ["run", "--model", "tiny-random", "--endpoint", "chat", "--workload", _workload(tmp_path),
            "--request-rate", "inf", "--out", str(out), "--quiet", "--slo", "p99"]  # fmt: skip
    for arg in server_args:
        args += ["--server-arg", arg]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code in (0, 1, 3), result.output  # 1, 3: the SLO failed or undecided
    requests = pq.read_table(out / "requests.parquet").to_pylist()
    chunks = pq.read_table(out / "chunks.parquet").to_pylist()
    return requests, json.loads((out / "summary.json").read_text()), chunks


def _check_split(requests: list[dict]) -> None:
    assert [r["status"] for r in requests] == ["ok"] * 4
    for r in requests:
        assert r["t_first_reasoning_token_ns"] is not None, r
        assert r["t_first_answer_token_ns"] > r["t_first_reasoning_token_ns"]
        # events of one socket read share its time: the last reasoning token may share it
        assert r["t_first_answer_token_ns"] >= r["t_last_reasoning_token_ns"]
        assert r["t_first_token_ns"] == r["t_first_reasoning_token_ns"]
        # tiny-random's tokens here: <think> is 7, the 12..16 letters at least 4 (3 a token)
        assert r["output_reasoning_tokens"] >= 7 + 4
        assert r["output_answer_tokens"] >= 1
        total = r["output_reasoning_tokens"] + r["output_answer_tokens"]
        assert total == r["usage_completion_tokens"] == r["output_tokens"]


def test_bench_run_splits_reasoning_from_the_engines_reasoning_parser(tmp_path):
    requests, summary, chunks = _run(tmp_path, "--reasoning-parser", "think")
    _check_split(requests)
    for r in requests:
        assert r["usage_reasoning_tokens"] == r["output_reasoning_tokens"]
    block = summary["reasoning"]
    assert block["requests_with_reasoning"] == 4
    assert block["ttft_answer_ms"]["p50"] > block["ttft_reasoning_ms"]["p50"]
    assert block["slo_ttft"] == "first_token"
    assert summary["slo"]["ttft"] == "first_token"
    # every chunk is marked; the marked ones hold exactly the reasoning tokens
    assert {c["is_reasoning"] for c in chunks} == {True, False}
    reasoning_by_chunks = sum(c["n_tokens"] for c in chunks if c["is_reasoning"])
    assert reasoning_by_chunks == sum(r["output_reasoning_tokens"] for r in requests)


def test_bench_run_splits_inline_think_tags_without_the_parser(tmp_path):
    requests, summary, _ = _run(tmp_path)
    _check_split(requests)
    assert {r["usage_reasoning_tokens"] for r in requests} == {None}
    assert summary["reasoning"]["requests_with_reasoning"] == 4
