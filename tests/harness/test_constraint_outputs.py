"""A workload's output constraint: the spec field is checked, requests carry it on the wire,
and every output is checked against it; an output that breaks it is `wrong_output` on the
card (through `bench run` against a server that ignores the constraint), one that holds is ok
(against the reference engine, which enforces it)."""

from __future__ import annotations

import json

import orjson
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from harness.cli import bench
from harness.http.client import ClientOptions, RawResult, build_body
from harness.load.output_checks import Expectation, OutputChecks
from harness.load.records import RecordContext, to_rows
from reports.build import build_card
from slo.runrecord import OutputFlag
from workloads.constraint import check_constraint, request_fields, violation
from workloads.schema import WorkloadError

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "maximum": 9}, "s": {"type": "string"}},
    "required": ["n"],
}


@pytest.mark.parametrize(
    "constraint, text, problem",
    [
        ({"json_schema": SCHEMA}, '{"n": 9, "s": "x"}', None),
        ({"json_schema": SCHEMA}, '{"n": 10}', "does not match its schema: 10 is greater"),
        ({"json_schema": SCHEMA}, '{"s": "x"}', "'n' is a required property"),
        ({"json_schema": SCHEMA}, '{"n": 1', "not valid JSON"),
        ({"json_schema": SCHEMA}, "", "not valid JSON"),
        ({"json_object": True}, '{"a": [1, 2]}', None),
        ({"json_object": True}, "[1, 2]", "JSON but not an object"),
        ({"regex": r"\d{2,3}"}, "12", None),
        ({"regex": r"\d{2,3}"}, "1234", "does not match the regex"),  # fullmatch, not search
        ({"regex": r"\d{2,3}"}, "1", "does not match the regex"),
        ({"choice": ["yes", "no"]}, "no", None),
        ({"choice": ["yes", "no"]}, "no ", "not one of the choices"),
        ({"grammar": 'root ::= "a"'}, "anything", None),  # not checked here
    ],
)
def test_violation(constraint, text, problem):
    check_constraint(constraint, "test")
    found = violation(constraint, text)
    if problem is None:
        assert found is None
    else:
        assert problem in found and found.endswith(".")


@pytest.mark.parametrize(
    "constraint, message",
    [
        ("json", "must be a mapping"),
        ({}, "exactly one of json_schema, json_object, regex, choice, grammar, got 0"),
        ({"regex": "a", "choice": ["a"]}, "got 2"),
        ({"xml": "a"}, "does not take xml"),
        ({"json_schema": {"type": "foo"}}, "not a valid JSON schema: 'foo' is not valid"),
        ({"json_schema": [1]}, "json_schema must be a mapping"),
        ({"json_object": False}, "json_object must be true"),
        ({"regex": "(ab"}, "regex does not compile"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", 2]}, "choice must be a non-empty list"),
        ({"grammar": 3}, "grammar must be a non-empty string"),
        ({"regex": "a", "name": "x"}, "applies to json_schema only"),
    ],
)
def test_bad_constraints_name_the_problem(constraint, message):
    with pytest.raises(WorkloadError, match=message) as info:
        check_constraint(constraint, "spec.yaml")
    assert str(info.value).startswith("spec.yaml: constraint ")


def test_requests_carry_the_constraint_on_the_wire():
    row = {"request_id": "r", "prompt": "hi", "max_output_tokens": 8}
    options = ClientOptions(base_url="http://x/v1", model="m", stream=False)
    body = orjson.loads(build_body(options, {**row, "constraint": {"json_schema": SCHEMA}}))
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": SCHEMA, "strict": True},
    }
    assert request_fields({"json_object": True}) == {"response_format": {"type": "json_object"}}
    assert request_fields({"regex": "a+"}) == {"structured_outputs": {"regex": "a+"}}
    assert request_fields({"choice": ["a"]}) == {"structured_outputs": {"choice": ["a"]}}
    plain = orjson.loads(build_body(options, {**row, "constraint": None}))
    assert "response_format" not in plain and "structured_outputs" not in plain


def _record(text: str, constraint: dict | None, reference: str | None = None):
    class Words:
        def encode(self, text: str) -> list[int]:
            return [hash(w) % 1000 for w in text.split()]

    checks = OutputChecks(
        Words(),
        {"r": Expectation(64, False, constraint)},
        {"r": reference} if reference is not None else None,
    )
    body = {"id": "c", "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(text.split())}}  # fmt: skip
    raw = RawResult("r", False, 0, t_sent_ns=10, t_done_ns=5_000, http_status=200,
                    body=orjson.dumps(body))  # fmt: skip
    record, _ = to_rows(raw, 3, RecordContext(t0_ns=0, is_chat=False, checks=checks))
    return record


def test_the_record_marks_outputs_against_the_constraint():
    good = _record('{"n": 3}', {"json_schema": SCHEMA})
    assert good.output_valid is True and good.output_flags is None
    bad = _record('{"n": "three"}', {"json_schema": SCHEMA})
    assert bad.output_valid is False and bad.output_flags == OutputFlag.CONSTRAINT_VIOLATED.value
    # Unconstrained and unchecked: no verdict; a grammar constraint is not checked here.
    assert _record("{", None).output_valid is None
    assert _record("{", {"grammar": 'root ::= "a"'}).output_valid is None
    # The constraint and the reference both judge: either failing makes it wrong.
    assert (
        _record('{"n": 3}', {"json_schema": SCHEMA}, reference="other words").output_valid is False
    )


def _spec(tmp_path, constraint: dict) -> str:
    spec = {"name": "constrained", "num_requests": 6, "ignore_eos": False,
            "source": {"kind": "synthetic", "input": {"dist": "fixed", "value": 8},
                       "output": {"dist": "fixed", "value": 64}},
            "constraint": constraint}  # fmt: skip
    path = tmp_path / "constrained.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_bench_run_counts_outputs_that_break_the_constraint_as_wrong(mock_server, tmp_path):
    """The mock server ignores `response_format` and writes words: every output is wrong."""
    workload = _spec(tmp_path, {"json_schema": SCHEMA})
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        result = CliRunner().invoke(bench, ["run", "--url", url, "--tokenizer", "tiny-random",
                                            "--workload", workload, "--request-rate", "inf",
                                            "--out", str(tmp_path / "r"), "--quiet"])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = pq.read_table(tmp_path / "r" / "requests.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok"] * 6
    assert [r["output_valid"] for r in rows] == [False] * 6
    assert {r["output_flags"] for r in rows} == {OutputFlag.CONSTRAINT_VIOLATED.value}
    failures = build_card(tmp_path / "r").failures
    assert (failures.wrong_output, failures.ok) == (6, 0)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["correctness"]["flags"][OutputFlag.CONSTRAINT_VIOLATED.value] == 6


@pytest.mark.slow
def test_bench_run_json_workload_on_the_reference_engine_is_all_valid(tmp_path):
    """The built-in `json` workload against tiny-random, which enforces the schema; with
    `--check-outputs` the oracle decodes under the same schema, so greedy outputs match it."""
    from engine_ref.core.grammar import grammar_available

    if not grammar_available():
        pytest.skip("xgrammar is not installed (pip install 'llm-bench-harness[grammar]')")
    result = CliRunner().invoke(bench, ["run", "--model", "tiny-random", "--workload", "json",
                                        "--num-requests", "6", "--request-rate", "inf", "--check-outputs",
                                        "--out", str(tmp_path / "r"), "--quiet"])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = pq.read_table(tmp_path / "r" / "requests.parquet").to_pylist()
    assert [(r["status"], r["output_valid"], r["finish_reason"]) for r in rows] == [
        ("ok", True, "stop")
    ] * 6
    assert [r["output_exact_match"] for r in rows] == [True] * 6
    failures = build_card(tmp_path / "r").failures
    assert (failures.wrong_output, failures.ok) == (0, 6)
