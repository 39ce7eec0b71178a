"""The `tools` workload through `bench run`: against the mock answering every request with one
call, a malformed call (arguments not JSON, a function not offered) is flagged
`tool_call_invalid` on every request and the card counts them as wrong output, while a valid
call passes; against the managed reference engine (tiny-random), which serves `required`
through its grammar path, every call of simple and parallel requests is valid."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import bench
from reports.build import build_card
from reports.checks_view import correctness_sentence
from slo.runrecord import OutputFlag

pytest.importorskip("jsonschema")
FLAG = OutputFlag.TOOL_CALL_INVALID.value


def _run(tmp_path, *args: str) -> list[dict]:
    out = tmp_path / "r"
    argv = ["run", "--workload", "tools", "--request-rate", "inf", "--out", str(out), "--quiet"]
    result = CliRunner().invoke(bench, [*argv, *args])
    assert result.exit_code == 0, result.output
    return pq.read_table(out / "requests.parquet").to_pylist()


@pytest.mark.parametrize("mode, valid", [("bad_json", False), ("unknown_function", False),
                                         ("valid", True)])  # fmt: skip
def test_the_mock_s_calls_are_checked(mock_server, tmp_path, mode, valid):
    with mock_server("--ttft-ms", "1", "--itl-ms", "1", "--tool-calls", mode) as url:
        rows = _run(tmp_path, "--url", url, "--tokenizer", "tiny-random", "--num-requests", "4")
    assert [(r["status"], r["finish_reason"], r["num_tool_calls"]) for r in rows] == [
        ("ok", "tool_calls", 1)
    ] * 4
    assert [r["output_valid"] for r in rows] == [valid] * 4
    assert {r["output_flags"] for r in rows} == ({None} if valid else {FLAG})
    # argument fragments are output events: a first token and one token per chunk
    assert all(r["t_first_token_ns"] is not None and r["output_tokens"] >= 1 for r in rows)
    failures = build_card(tmp_path / "r").failures
    assert (failures.wrong_output, failures.ok) == ((0, 4) if valid else (4, 0))
    correctness = json.loads((tmp_path / "r" / "summary.json").read_text())["correctness"]
    # the check ran on every answer either way, and the card says so
    assert (correctness["tool_answers_checked"], correctness["tool_calls_made"]) == (4, 4)
    assert correctness["flags"][FLAG] == (0 if valid else 4)
    sentence = correctness_sentence(build_card(tmp_path / "r").correctness)
    assert f"tool calls checked in 4 answers: 4 calls, {0 if valid else 4} answers" in sentence


@pytest.mark.slow
def test_the_reference_engine_s_calls_are_all_valid(tmp_path):
    from engine_ref.core.grammar import grammar_available

    if not grammar_available():
        pytest.skip("xgrammar is not installed (pip install 'llm-bench-harness[grammar]')")
    rows = _run(tmp_path, "--model", "tiny-random", "--num-requests", "4")
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    parallel = manifest["workload"]["tools"]["parallel"]
    assert set(parallel) == {False, True}  # simple and parallel requests both sent
    by_id = {r["request_id"]: r for r in rows}
    assert len(by_id) == 4
    for k, is_parallel in enumerate(parallel):
        row = by_id[f"req-{k:06d}"]
        assert (row["status"], row["output_valid"], row["output_flags"]) == ("ok", True, None)
        assert row["finish_reason"] == "tool_calls"
        assert 1 <= row["num_tool_calls"] <= (8 if is_parallel else 1)
    failures = build_card(tmp_path / "r").failures
    assert (failures.wrong_output, failures.ok) == (0, 4)
