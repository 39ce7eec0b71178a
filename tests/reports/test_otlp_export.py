"""`bench export RUN --format otlp-json`: one span per sent request at the recorded times,
the GenAI semantic-convention attributes, and a document the OpenTelemetry protobuf decoder
(`opentelemetry-proto`) reads.

OTLP/JSON writes trace and span ids as hex, where protobuf's own JSON mapping expects base64
(opentelemetry-proto `docs/specification.md`, "JSON Protobuf Encoding"); `_decode` converts
the ids, as an OTLP/JSON receiver does, then hands the document to `json_format.Parse`.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from reports.cli_export import export
from slo.runrecord import RequestRecord, RunManifest, RunWriter

json_format = pytest.importorskip("google.protobuf.json_format")
trace_service = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="opentelemetry-proto is in the test extra",
)
from opentelemetry.proto.trace.v1 import trace_pb2  # noqa: E402

MS = 1_000_000
# 2026-11-29T10:00:00Z in ns since the Unix epoch (`date -u -d 2026-11-29T10:00:00Z +%s`).
T0_UNIX_NS = 1_795_946_400_000_000_000
STARTED_AT = "2026-11-29T10:00:00+00:00"


def _write_run(path: Path, started_at: str | None = STARTED_AT, run_id: str = "run-a") -> Path:
    """Four requests (times in ms from t0):
    r1 ok: scheduled 0, sent 1, first byte 40, a role-only event at 45, tokens at 50, 70, 90
       (first token 50, last 90), done 91; 12 prompt tokens by usage (10 by the workload), 5 out.
    r2 error (http_5xx, 503): scheduled 10, sent 12, first byte 20, done 25; no usage: 7 in.
    r3 not_sent: scheduled 30, never sent.
    r4 cancelled: scheduled 35, sent 40, done 60; no error class.
    """
    manifest = RunManifest(
        harness_version="0.1.0",
        run_id=run_id,
        target={"url": "http://10.0.0.5:8000", "model": "tiny", "engine": "vllm",
                "endpoint": "/v1/chat/completions"},
        config={"stream": True},
        started_at=started_at,
        t0_ns=987_654_321_000,  # a perf_counter reading: no wall-clock meaning
    )  # fmt: skip
    rows = [
        RequestRecord(request_id="r1", t_scheduled_ns=0, t_sent_ns=1 * MS,
                      t_first_byte_ns=40 * MS, t_first_token_ns=50 * MS, t_last_token_ns=90 * MS,
                      t_done_ns=91 * MS, status="ok", http_status=200, finish_reason="stop",
                      input_tokens=10, usage_prompt_tokens=12, output_tokens=5,
                      output_tokens_source="usage", response_id="chatcmpl-1",
                      usage_cached_tokens=8, session_id="s1", turn_index=0, priority=0,
                      deadline_ms=500, tenant="team-a"),
        RequestRecord(request_id="r2", t_scheduled_ns=10 * MS, t_sent_ns=12 * MS,
                      t_first_byte_ns=20 * MS, t_done_ns=25 * MS, status="error",
                      http_status=503, error_class="http_5xx",
                      error_message="service unavailable", input_tokens=7, output_tokens=0),
        RequestRecord(request_id="r3", t_scheduled_ns=30 * MS, status="not_sent", input_tokens=9),
        RequestRecord(request_id="r4", t_scheduled_ns=35 * MS, t_sent_ns=40 * MS,
                      t_done_ns=60 * MS, status="cancelled", input_tokens=4),
    ]  # fmt: skip
    path.mkdir(parents=True)
    writer = RunWriter(path, manifest)
    writer.append_requests(rows)
    writer.append_chunks([("r1", 45 * MS, 0, 0), ("r1", 50 * MS, 1, 4), ("r1", 70 * MS, 2, 8),
                          ("r1", 90 * MS, 2, 8)])  # fmt: skip
    writer.close(complete=True)
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return _write_run(tmp_path_factory.mktemp("otlp") / "run-a")


def _export(run: Path) -> dict:
    result = CliRunner().invoke(export, [str(run), "--format", "otlp-json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.fixture(scope="module")
def doc(run) -> dict:
    return _export(run)


def _spans(doc: dict) -> list[dict]:
    return doc["resourceSpans"][0]["scopeSpans"][0]["spans"]


def _by_request(doc: dict) -> dict[str, dict]:
    return {_attrs(s)["llm_bench.request_id"]: s for s in _spans(doc) if s["kind"] == 3}


def _attrs(span: dict) -> dict:
    out = {}
    for kv in span["attributes"]:
        ((kind, value),) = kv["value"].items()
        if kind == "arrayValue":
            value = [next(iter(v.values())) for v in value["values"]]
        out[kv["key"]] = int(value) if kind == "intValue" else value
    return out


def _decode(doc: dict):
    """The document as the protobuf `ExportTraceServiceRequest`: hex ids to base64 first."""
    doc = copy.deepcopy(doc)
    for resource in doc["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return json_format.Parse(json.dumps(doc), trace_service.ExportTraceServiceRequest())


def test_one_span_per_sent_request_at_the_recorded_times(doc):
    """r1: start t0 + 1 ms, end t0 + 91 ms; r3 was never sent, so it has no span."""
    requests = _by_request(doc)
    assert sorted(requests) == ["r1", "r2", "r4"]
    r1 = requests["r1"]
    assert r1["startTimeUnixNano"] == "1795946400001000000"
    assert r1["endTimeUnixNano"] == "1795946400091000000"
    assert [(e["name"], e["timeUnixNano"]) for e in r1["events"]] == [
        ("llm_bench.scheduled", "1795946400000000000"),
        ("llm_bench.sent", "1795946400001000000"),
        ("llm_bench.first_byte", "1795946400040000000"),
        ("llm_bench.first_token", "1795946400050000000"),
        ("llm_bench.last_token", "1795946400090000000"),
        ("llm_bench.done", "1795946400091000000"),
    ]
    r2 = requests["r2"]
    assert (r2["startTimeUnixNano"], r2["endTimeUnixNano"]) == (
        "1795946400012000000", "1795946400025000000")  # fmt: skip
    phases = ["scheduled", "sent", "first_byte", "done"]  # no token: no token events
    assert [e["name"] for e in r2["events"]] == [f"llm_bench.{p}" for p in phases]
    root = next(s for s in _spans(doc) if "parentSpanId" not in s)
    assert (root["startTimeUnixNano"], root["endTimeUnixNano"]) == (
        "1795946400000000000", "1795946400091000000")  # fmt: skip
    assert _attrs(root)["llm_bench.requests.not_sent"] == 1
    assert _attrs(root)["llm_bench.requests.total"] == 4
    # the time to first token: a child of r1 from its send to its first token; none for r2, r4
    ttft = [s for s in _spans(doc) if s["name"] == "time_to_first_token"]
    assert len(ttft) == 1 and ttft[0]["parentSpanId"] == r1["spanId"]
    assert (ttft[0]["startTimeUnixNano"], ttft[0]["endTimeUnixNano"]) == (
        "1795946400001000000", "1795946400050000000")  # fmt: skip
    assert len(_spans(doc)) == 1 + 3 + 1
    # one trace; every request span is a child of the run's root span
    assert {s["traceId"] for s in _spans(doc)} == {root["traceId"]}
    assert {s["parentSpanId"] for s in requests.values()} == {root["spanId"]}


def test_genai_attributes_of_an_ok_request(doc):
    """r1: usage's 12 prompt tokens, not the workload's 10; the first stream event (the
    role-only one at 45 ms) 44 ms after the send."""
    r1 = _by_request(doc)["r1"]
    assert r1["name"] == "chat tiny"
    assert r1["status"] == {}
    assert _attrs(r1) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "tiny",
        "gen_ai.request.stream": True,
        "server.address": "10.0.0.5",
        "server.port": 8000,
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 5,
        "gen_ai.usage.cache_read.input_tokens": 8,
        "gen_ai.response.finish_reasons": ["stop"],
        "gen_ai.response.id": "chatcmpl-1",
        "gen_ai.response.time_to_first_chunk": pytest.approx(0.044),
        "gen_ai.conversation.id": "s1",
        "http.response.status_code": 200,
        "llm_bench.request_id": "r1",
        "llm_bench.status": "ok",
        "llm_bench.output_tokens_source": "usage",
        "llm_bench.turn_index": 0,
        "llm_bench.priority": 0,
        "llm_bench.deadline_ms": 500,
        "llm_bench.tenant": "team-a",
    }


def test_failed_requests_carry_error_type_and_an_error_status(doc):
    r2, r4 = _by_request(doc)["r2"], _by_request(doc)["r4"]
    a2 = _attrs(r2)
    assert a2["error.type"] == "http_5xx" and a2["http.response.status_code"] == 503
    assert a2["gen_ai.usage.input_tokens"] == 7  # no usage: the workload's count
    assert "gen_ai.response.finish_reasons" not in a2 and "llm_bench.tenant" not in a2
    assert r2["status"] == {"code": 2, "message": "service unavailable"}
    # cancelled has no error class: the status names it
    assert _attrs(r4)["error.type"] == "cancelled" and r4["status"]["code"] == 2
    assert "error.type" not in _attrs(_by_request(doc)["r1"])


def test_the_document_loads_with_the_opentelemetry_protobuf_decoder(doc):
    request = _decode(doc)
    spans = request.resource_spans[0].scope_spans[0].spans
    assert len(spans) == 5
    by_id = {s.span_id.hex(): s for s in spans}
    r1 = by_id[_by_request(doc)["r1"]["spanId"]]
    assert len(r1.trace_id) == 16 and len(r1.span_id) == 8 and len(r1.parent_span_id) == 8
    assert r1.trace_id.hex() == doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"]
    assert r1.kind == trace_pb2.Span.SPAN_KIND_CLIENT
    assert r1.start_time_unix_nano == T0_UNIX_NS + 1 * MS
    assert r1.end_time_unix_nano == T0_UNIX_NS + 91 * MS
    offsets = [e.time_unix_nano - T0_UNIX_NS for e in r1.events]
    assert offsets == [0, 1 * MS, 40 * MS, 50 * MS, 90 * MS, 91 * MS]
    typed = {kv.key: kv.value for kv in r1.attributes}
    assert typed["gen_ai.usage.output_tokens"].int_value == 5
    assert typed["gen_ai.request.stream"].bool_value is True
    reasons = typed["gen_ai.response.finish_reasons"].array_value.values
    assert [v.string_value for v in reasons] == ["stop"]
    r2 = by_id[_by_request(doc)["r2"]["spanId"]]
    assert r2.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    resource = {
        kv.key: kv.value.string_value for kv in request.resource_spans[0].resource.attributes
    }
    assert resource["service.name"] == "llm-bench"


def _break_trace_id(d):
    d["resourceSpans"][0]["scopeSpans"][0]["spans"][1]["traceId"] = "not-a-hex-trace-id!"


def _name_as_number(d):
    d["resourceSpans"][0]["scopeSpans"][0]["spans"][1]["name"] = 5


def _time_as_word(d):
    d["resourceSpans"][0]["scopeSpans"][0]["spans"][1]["startTimeUnixNano"] = "soon"


def _unknown_field(d):
    d["resourceSpans"][0]["scopeSpans"][0]["spans"][1]["startTime"] = "1"


@pytest.mark.parametrize("breaks", [_break_trace_id, _name_as_number, _time_as_word,
                                    _unknown_field])  # fmt: skip
def test_a_malformed_document_fails_the_decoder(doc, breaks):
    """Negative control: the decode is a real check; each broken document is refused."""
    broken = copy.deepcopy(doc)
    breaks(broken)
    with pytest.raises((ValueError, json_format.ParseError)):
        _decode(broken)


def test_hex_ids_read_as_base64_come_out_wrong(doc):
    """Why `_decode` converts: protobuf's own mapping reads the 32 hex digits as base64 and
    gets 24 bytes, not a 16-byte trace id."""
    request = json_format.Parse(json.dumps(doc), trace_service.ExportTraceServiceRequest())
    assert len(request.resource_spans[0].scope_spans[0].spans[0].trace_id) == 24


def test_trace_id_is_the_run_id_s(run, tmp_path):
    """Same run id, same ids (an export is repeatable); another run id, another trace."""
    again = _export(_write_run(tmp_path / "copy", run_id="run-a"))
    other = _export(_write_run(tmp_path / "b", run_id="run-b"))
    first = _export(run)
    assert [s["spanId"] for s in _spans(again)] == [s["spanId"] for s in _spans(first)]
    assert _spans(again)[0]["traceId"] == _spans(first)[0]["traceId"]
    assert _spans(other)[0]["traceId"] != _spans(first)[0]["traceId"]
    assert len(_spans(first)[0]["traceId"]) == 32 and len(_spans(first)[0]["spanId"]) == 16


@pytest.mark.parametrize(
    ("started_at", "r1_start"),
    [
        ("2026-11-29T10:00:00+00:00", "1795946400001000000"),
        ("2026-11-29T11:00:00+0100", "1795946400001000000"),  # the same instant, as %z writes
        ("2026-11-29T10:00:01+00:00", "1795946401001000000"),  # one second later
    ],
)
def test_the_wall_clock_start_is_the_manifest_s(tmp_path, started_at, r1_start):
    doc = _export(_write_run(tmp_path / "r", started_at=started_at))
    assert _by_request(doc)["r1"]["startTimeUnixNano"] == r1_start


@pytest.mark.parametrize("started_at", [None, "2026-11-29T10:00:00", "yesterday"])
def test_a_run_without_a_usable_start_is_refused_in_one_sentence(tmp_path, started_at):
    run = _write_run(tmp_path / "r", started_at=started_at)
    result = CliRunner().invoke(export, [str(run), "--format", "otlp-json"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "started_at" in result.output and result.output.count("\n") == 1


def test_to_a_file_and_a_directory_that_is_no_run(run, tmp_path):
    out = tmp_path / "trace.json"
    result = CliRunner().invoke(export, [str(run), "--format", "otlp-json", "-o", str(out)])
    assert result.exit_code == 0 and len(_spans(json.loads(out.read_text()))) == 5
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(export, [str(empty), "--format", "otlp-json"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "requests.parquet" in result.output
