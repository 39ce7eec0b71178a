"""`bench export --format vllm|llmd` against what other tools read today.

vLLM: the fields `vllm bench serve --save-result` writes (vllm-project/vllm
`vllm/benchmarks/serve.py` at 009e6d4a1cd6ba3fb2a9fc00f4ec06f5297232a1), checked as a field
list (JSON Schema below) and, on a five-request run written with the production writer,
value by value against figures worked out by hand. llm-d: the Benchmark Report v0.2.1,
validated against its published JSON Schema (fetched data beside the clone: `llmd_schemas`) and the
per-field unit rules of llm-d's models. Each check has a negative control: a report with a
required field dropped or a type corrupted must fail it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from llmd_schemas import V0_2, V0_2_1, llmd_schema
from rundir_builder import SyntheticRun, write_run

from reports.cli_export import export
from slo.runrecord import RequestRecord, RunManifest, RunWriter, TokenSource

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")
NS = 1_000_000_000

_NUMBER = {"type": "number"}
_NUMBER_OR_NULL = {"type": ["number", "null"]}
_SECONDS = {"type": "array", "items": _NUMBER_OR_NULL}
# vLLM's result keys for a generation run (`benchmark` and `main_async` in serve.py); the
# per-request arrays are in every file (latencies, queue_times) or only with --save-detailed.
VLLM_RESULT = {
    "type": "object",
    "required": ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
                 "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
                 "completed", "failed", "total_input_tokens", "total_output_tokens",
                 "request_throughput", "request_goodput", "output_throughput",
                 "total_token_throughput", "latencies", "queue_times",
                 "max_output_tokens_per_s", "max_concurrent_requests", "rtfx"],
    "properties": {
        "duration": _NUMBER, "completed": {"type": "integer"}, "failed": {"type": "integer"},
        "num_prompts": {"type": "integer"}, "request_goodput": _NUMBER_OR_NULL,
        "request_throughput": _NUMBER_OR_NULL, "max_output_tokens_per_s": _NUMBER,
        "max_concurrent_requests": {"type": "integer", "minimum": 0}, "rtfx": _NUMBER,
        "total_input_tokens": {"type": "integer"}, "total_output_tokens": {"type": "integer"},
        "latencies": _SECONDS, "queue_times": _SECONDS, "ttfts": _SECONDS, "start_times": _SECONDS,
        "input_lens": {"type": "array", "items": {"type": ["integer", "null"]}},
        "output_lens": {"type": "array", "items": {"type": "integer"}},
        "itls": {"type": "array", "items": {"type": "array", "items": _NUMBER}},
        "generated_texts": {"type": "array", "items": {"type": ["string", "null"]}},
        "errors": {"type": "array", "items": {"type": "string"}},
    },
}  # fmt: skip
VLLM_DETAILED = ["input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts",
                 "errors"]  # fmt: skip
# llm-d's per-field unit rules (schema_v0_2.py check_units, schema_v0_2_1.py UNIT_RULES), which
# its JSON Schema does not carry: path under results -> allowed units
LLMD_UNITS = {
    ("request_performance", "aggregate", "latency", "time_to_first_token"): {"ms", "s"},
    ("request_performance", "aggregate", "latency", "request_latency"): {"ms", "s"},
    ("request_performance", "aggregate", "latency", "time_per_output_token"): {"ms/token", "s/token"},
    ("request_performance", "aggregate", "latency", "inter_token_latency"): {"ms/token", "s/token"},
    ("request_performance", "aggregate", "latency", "normalized_time_per_output_token"):
        {"ms/token", "s/token"},
    ("request_performance", "aggregate", "requests", "input_length"): {"count", "pixels"},
    ("request_performance", "aggregate", "requests", "output_length"): {"count", "pixels"},
    ("request_performance", "aggregate", "throughput", "output_token_rate"): {"tokens/s"},
    ("request_performance", "aggregate", "throughput", "request_rate"): {"queries/s"},
    ("session_performance", "sessions", "session_duration"): {"ms", "s"},
    ("session_performance", "sessions", "events_per_session"): {"count", "pixels"},
}  # fmt: skip


def vllm_result_errors(data: dict, *, detailed: bool) -> list[str]:
    """What is wrong with `data` as a vLLM result file (empty: nothing)."""
    schema = dict(
        VLLM_RESULT, required=VLLM_RESULT["required"] + (VLLM_DETAILED if detailed else [])
    )
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(data)]
    for key in ["latencies", "queue_times"] + (VLLM_DETAILED if detailed else []):
        if isinstance(data.get(key), list) and len(data[key]) != data.get("num_prompts"):
            errors.append(f"{key} has {len(data[key])} entries for {data.get('num_prompts')}")
    if not detailed:
        errors += [f"{key} without --save-detailed" for key in VLLM_DETAILED if key in data]
    return errors


def llmd_errors(report: dict, version: str = V0_2_1) -> list[str]:
    """What is wrong with `report` as an llm-d Benchmark Report (empty: nothing)."""
    schema = llmd_schema(version)
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(report)]
    for path, allowed in LLMD_UNITS.items():
        node = report.get("results", {})
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None and node.get("units") not in allowed:
            errors.append(f"{'.'.join(path)} in {node.get('units')!r}, not one of {allowed}")
    return errors


# request: (scheduled s, sent s, token chunk times s, done s, input tokens, status, session, turn)
HAND_RUN = {
    "A": (0.0, 0.0, (0.2, 0.4, 1.2), 1.3, 10, "ok", "s1", 0),
    "E": (0.5, 0.5, (1.1,), 1.15, 20, "ok", None, None),
    "B": (1.4, 1.5, (1.7, 1.9), 2.0, 30, "ok", "s1", 1),
    "C": (1.6, 1.6, (), 1.65, 40, "error", "s2", 0),
    "D": (1.85, 1.9, (2.0,), 2.05, 50, "ok", "s2", 1),
}


def write_hand_run(path: Path, *, slo: dict | None, config: dict) -> Path:
    """The five requests of HAND_RUN through the production writer (completions endpoint)."""
    manifest = RunManifest(
        run_id="hand", started_at="2026-11-29T10:00:00+00:00", t0_ns=0, slo=slo, config=config,
        target={"kind": "url", "url": "http://127.0.0.1:8000/v1", "model": "org/m",
                "endpoint": "/v1/completions", "engine": "vllm"},
        workload={"name": "hand", "tokenizer": "tiny-random", "sha256": "b" * 64},
    )  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    writer = RunWriter(path, manifest)
    records, chunks = [], []
    for rid, (sched, sent, tokens, done, n_in, status, session, turn) in HAND_RUN.items():
        row = RequestRecord(request_id=rid, is_warmup=False, t_scheduled_ns=round(sched * NS),
                            t_sent_ns=round(sent * NS), input_tokens=n_in)  # fmt: skip
        row.status, row.t_done_ns = status, round(done * NS)
        row.session_id, row.turn_index = session, turn
        row.output_tokens = row.client_output_tokens = row.num_chunks = len(tokens)
        row.output_tokens_source = TokenSource.USAGE if tokens else TokenSource.CHUNK_COUNT
        if status == "ok":
            row.http_status, row.finish_reason = 200, "length"
            row.t_first_token_ns, row.t_last_token_ns = (
                round(tokens[0] * NS),
                round(tokens[-1] * NS),
            )
        else:
            row.http_status, row.error_class, row.error_message = 500, "http_5xx", "boom"
        records.append(row)
        chunks += [(rid, round(t * NS), 1, 4) for t in tokens]
    writer.write_schedule([(r.request_id, r.t_scheduled_ns / NS, False) for r in records])
    writer.append_requests(records)
    writer.append_chunks(chunks)
    writer.close(complete=True)
    return path


def _export(run: Path, *args) -> dict:
    result = CliRunner().invoke(export, [str(run), *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


LIMITS_AT_B = {"name": "hand", "per_request": {"ttft_ms": 200.0, "tpot_ms": 200.0}}


@pytest.fixture(scope="module")
def hand_run(tmp_path_factory):
    config = {"concurrency": 2, "request_rate": 2.0}
    return write_hand_run(tmp_path_factory.mktemp("hand") / "run", slo=LIMITS_AT_B, config=config)


def test_vllm_export_current_fields_by_hand(hand_run):
    """Worked by hand from HAND_RUN (vLLM's completions definitions: latency ends at the
    last token chunk). Tokens per second from the first send: bucket 0 holds A's 0.2 and 0.4,
    bucket 1 A's 1.2, E's 1.1 and B's 1.7 and 1.9, bucket 2 D's 2.0: [2, 4, 1], peak 4. In
    flight over [send, send + latency): A [0, 1.2), E [0.5, 1.1), B [1.5, 1.9), D [1.9, 2.0):
    two at most (B ends as D starts, so they do not overlap; per-second buckets would say 4).
    Good under ttft <= 200 ms and tpot <= 200 ms: B (exactly at both limits) and D (100 ms,
    one token so no TPOT); A's TPOT is 500 ms and E's TTFT 600 ms. Window: 0 to 2.05 s."""
    data = _export(hand_run, "--format", "vllm", "--detailed")
    assert vllm_result_errors(data, detailed=True) == []
    assert data["max_output_tokens_per_s"] == 4.0
    assert data["max_concurrent_requests"] == 2
    assert data["duration"] == pytest.approx(2.05)
    assert data["request_goodput"] == pytest.approx(2 / 2.05)
    assert data["request_throughput"] == pytest.approx(4 / 2.05)
    assert (data["completed"], data["failed"], data["num_prompts"]) == (4, 1, 5)
    assert (data["total_input_tokens"], data["total_output_tokens"]) == (110, 7)
    assert data["input_lens"] == [10, 20, 30, 40, 50]
    assert data["output_lens"] == [3, 1, 2, 0, 1]
    assert data["ttfts"] == pytest.approx([0.2, 0.6, 0.2, None, 0.1])
    assert data["latencies"] == pytest.approx([1.2, 0.6, 0.4, None, 0.1])
    assert data["itls"] == [pytest.approx([0.2, 0.8]), [], pytest.approx([0.2]), [], []]
    assert data["start_times"] == pytest.approx([0.0, 0.5, 1.5, 1.6, 1.9])
    assert data["queue_times"] == pytest.approx([0.0, 0.0, 0.1, 0.0, 0.05])
    assert data["errors"] == ["", "", "", "boom", ""]
    assert data["generated_texts"] == [None] * 5
    assert data["mean_ttft_ms"] == pytest.approx(275.0)  # (200 + 600 + 200 + 100) / 4
    assert data["mean_tpot_ms"] == pytest.approx(350.0)  # A 500, B 200; E and D undefined
    assert data["rtfx"] == 0.0


@pytest.mark.parametrize(
    ("per_request", "expected_good"),
    [
        ({"ttft_ms": 200.0, "tpot_ms": 200.0}, 2),  # at the limit: B and D
        ({"ttft_ms": 199.9, "tpot_ms": 200.0}, 1),  # just below B's TTFT: D alone
        ({"ttft_ms": 600.0, "tpot_ms": 500.0}, 4),  # above everyone's: every ok request
        (None, None),  # no SLO: null, as vLLM without --goodput
        ({}, None),  # an SLO of percentiles only: no request is judged, so null too
    ],
)
def test_request_goodput_at_the_limits(tmp_path, per_request, expected_good):
    p99 = [{"metric": "ttft_ms", "percentile": 99, "max_ms": 200.0}]
    slo = None if per_request is None else {"name": "g", "per_request": per_request,
                                            "percentiles": p99}  # fmt: skip
    data = _export(write_hand_run(tmp_path / "r", slo=slo, config={}), "--format", "vllm")
    if expected_good is None:
        assert data["request_goodput"] is None
    else:
        assert data["request_goodput"] == pytest.approx(expected_good / 2.05)


def test_vllm_client_queue_metrics_only_with_max_concurrency(hand_run, tmp_path):
    """--percentile-metrics client_queue_time,e2el_including_client_queue: queue times of the
    ok requests 0, 0, 100, 50 ms (mean 37.5); with their latencies 1200, 600, 500, 150 ms
    (mean 612.5). Without --max-concurrency vLLM writes neither, and at rate inf only the first."""
    from reports.exports.vllm import vllm_result

    metrics = ("client_queue_time", "e2el_including_client_queue")
    data = vllm_result(hand_run, percentile_metrics=metrics)
    assert data["mean_client_queue_time_ms"] == pytest.approx(37.5)
    assert data["mean_e2el_including_client_queue_ms"] == pytest.approx(612.5)
    assert data["p99_client_queue_time_ms"] == pytest.approx(98.5)  # rank 2.97 of 0, 0, 50, 100
    unlimited = vllm_result(write_hand_run(tmp_path / "r", slo=None, config={}),
                            percentile_metrics=metrics)  # fmt: skip
    assert not any("client_queue" in key for key in unlimited)
    at_inf = write_hand_run(
        tmp_path / "inf", slo=None, config={"concurrency": 2, "request_rate": "inf"}
    )
    keys = set(vllm_result(at_inf, percentile_metrics=metrics))
    assert "mean_client_queue_time_ms" in keys  # at rate inf vLLM keeps the queue time only
    assert not any("including_client_queue" in key for key in keys)


def test_vllm_export_without_detailed_keeps_vllm_s_field_set(hand_run):
    data = _export(hand_run, "--format", "vllm")
    assert vllm_result_errors(data, detailed=False) == []
    assert data["latencies"] == pytest.approx([1.2, 0.6, 0.4, None, 0.1])


@pytest.mark.parametrize(
    "breakage",
    [
        lambda d: d.pop("max_concurrent_requests"),
        lambda d: d.pop("request_goodput"),
        lambda d: d.update(max_concurrent_requests="2"),
        lambda d: d.update(itls=[[0.2, "0.8"]] + d["itls"][1:]),
        lambda d: d.update(latencies=d["latencies"][:-1]),
    ],
    ids=["no-max-concurrent", "no-goodput", "concurrency-as-text", "itl-as-text", "short-array"],
)
def test_vllm_field_check_refuses_a_broken_result(hand_run, breakage):
    """Negative control: the field check fails a result with a field dropped or mistyped."""
    data = _export(hand_run, "--format", "vllm", "--detailed")
    breakage(data)
    assert vllm_result_errors(data, detailed=True)


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    spec = SyntheticRun(n_requests=40, failures={"rejected": 2, "timeout": 1})
    return write_run(tmp_path_factory.mktemp("llmd") / "run", spec)


def test_llmd_report_is_v0_2_1_and_validates(synthetic_run):
    report = _export(synthetic_run, "--format", "llmd")
    assert report["version"] == "0.2.1"
    assert llmd_errors(report) == []
    assert llmd_errors(report, V0_2) == []  # v0.2.1 only adds: a v0.2 reader takes it
    assert "session_performance" not in report["results"]  # no sessions in this run


def test_llmd_session_performance_by_hand(hand_run):
    """Sessions of HAND_RUN: s1 = A, B (both ok, from A's send at 0 to B's done at 2.0 s);
    s2 = C (error), D. One succeeded, one failed; four turns, three ok; two a session."""
    report = _export(hand_run, "--format", "llmd")
    assert llmd_errors(report) == []
    sessions = report["results"]["session_performance"]["sessions"]
    assert {
        k: sessions[k]
        for k in ("total", "succeeded", "failed", "total_events", "total_events_completed")
    } == {"total": 2, "succeeded": 1, "failed": 1, "total_events": 4, "total_events_completed": 3}
    assert sessions["session_duration"] == {"units": "s", **dict.fromkeys(
        ("mean", "p50", "p90", "p95", "p99", "max"), pytest.approx(2.0))}  # fmt: skip
    assert sessions["events_per_session"]["mean"] == 2.0
    assert sessions["events_per_session"]["units"] == "count"


@pytest.mark.parametrize(
    ("path", "breakage"),
    [
        (("run",), lambda r: r.pop("run")),  # a required part
        (("run", "uid"), lambda r: r["run"].pop("uid")),  # a required id
        (("requests",), lambda r: _aggregate(r)["requests"].update(total="40")),  # a type
        (("latency",), lambda r: _aggregate(r)["latency"]["request_latency"].pop("units")),
        (
            ("units",),
            lambda r: _aggregate(r)["latency"]["time_to_first_token"].update(units="ms/token"),
        ),  # a unit llm-d's models refuse for TTFT
        (
            ("sessions",),
            lambda r: r["results"]["session_performance"]["sessions"].update(failed=-1),
        ),
        (("extra",), lambda r: r["results"].update(latency={})),  # no such field
    ],
    ids=lambda p: "-".join(p) if isinstance(p, tuple) else "",
)
def test_llmd_validation_refuses_a_broken_report(hand_run, path, breakage):
    """Negative control: the schema (and unit) check fails each broken report."""
    report = _export(hand_run, "--format", "llmd")
    breakage(report)
    assert llmd_errors(report)


def _aggregate(report: dict) -> dict:
    return report["results"]["request_performance"]["aggregate"]
