"""The bad-input probe: its case table, the verdict on one answer, whole runs against a
well-behaved test server and against servers broken on purpose (500s, a hang, a crash), the
CLI's exit statuses, the console table, and (slow) a run against the reference server."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from broken_servers import MODEL, Fault, completion_text, create_app, serving
from click.testing import CliRunner
from rich.console import Console

from faults.probe import REFERENCE_PROMPT, ProbeConfig, ProbeError, judge, run_probe
from faults.probe_cases import build_cases
from faults.probe_cases.case import EITHER, LIMIT, LIMIT_OR_OK, REJECT, Category
from faults.probe_cases.sizes import OVERSIZED_BODY_BYTES
from faults.probe_cli import bad_input, render_report
from faults.probe_report import (
    CaseResult,
    HealthAfter,
    ProbeReport,
    StreamFailure,
    StreamsResult,
    Verdict,
)
from faults.raw_http import HttpAnswer, LazyBody, Outcome

ERROR_BODY = b'{"error": {"message": "bad field"}}'
COMPLETION = b'{"choices": [{"text": "hi"}]}'
NUMERIC_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "min_tokens",
)


def _probe(url: str, **config) -> ProbeReport:
    return asyncio.run(run_probe(ProbeConfig(url=url, **config)))


def _by_name(report: ProbeReport) -> dict[str, CaseResult]:
    return {r.name: r for r in report.results}


# --- the case table -------------------------------------------------------------------------


def test_the_table_has_every_category_and_unique_names():
    cases = build_cases("m")
    assert len(cases) >= 40
    assert {c.category for c in cases} == set(Category)
    assert len({c.name for c in cases}) == len(cases)


@pytest.mark.parametrize("field", NUMERIC_FIELDS)
def test_every_numeric_field_gets_every_extreme_as_a_bare_json_token(field):
    cases = {c.name: c for c in build_cases("m")}
    sent = {
        label: cases[f"{field}={label}"].body
        for label in ("0", "-1", "2**63", "2**64", "1e20", "NaN", "Infinity")
    }
    assert f'"{field}": 9223372036854775808'.encode() in sent["2**63"]
    assert f'"{field}": 18446744073709551616'.encode() in sent["2**64"]
    assert f'"{field}": 1e+20'.encode() in sent["1e20"]
    assert f'"{field}": NaN'.encode() in sent["NaN"]
    assert f'"{field}": Infinity'.encode() in sent["Infinity"]


def test_bodies_that_must_be_malformed_are():
    cases = {c.name: c for c in build_cases("m")}
    for name in ("invalid-utf8-bytes", "overlong-utf8", "utf8-encoded-surrogate", "truncated-utf8"):
        with pytest.raises(UnicodeDecodeError):
            cases[name].body.decode("utf-8")
    for name in ("truncated-json", "trailing-garbage", "two-objects", "chat-truncated-json"):
        with pytest.raises(json.JSONDecodeError):
            json.loads(cases[name].body)
    nested = cases["nested-lists-prompt"].body
    assert nested.count(b"[") == 10_000 and nested.count(b"]") == 10_000
    assert len(cases["header-100kb"].headers[0][1]) == 100 * 1024
    assert len(cases["headers-1000"].headers) == 1000
    assert len(json.loads(cases["stop-100k"].body)["stop"]) == 100_000
    assert len(json.loads(cases["huge-prompt-5mb"].body)["prompt"]) >= 5 * 10**6


@pytest.mark.parametrize("name", ["body-64mb", "body-64mb-chunked"])
def test_the_oversized_body_is_generated_lazily_as_one_json_object(name):
    body = {c.name: c for c in build_cases("m")}[name].body
    assert isinstance(body, LazyBody)
    assert body.size == (OVERSIZED_BODY_BYTES if name == "body-64mb" else None)
    pieces = list(body.pieces())
    assert max(len(p) for p in pieces) <= 1024 * 1024
    assert sum(len(p) for p in pieces) == OVERSIZED_BODY_BYTES
    assert pieces[0].startswith(b'{"model": "m"') and pieces[-1] == b'"}'


# --- the verdict on one answer --------------------------------------------------------------


def _answered(status: int, body: bytes = b"") -> HttpAnswer:
    return HttpAnswer(Outcome.ANSWERED, 1.0, status, body)


@pytest.mark.parametrize(
    ("expect", "answer", "verdict", "reason"),
    [
        (REJECT, _answered(400, ERROR_BODY), "pass", "rejected with 400 and an OpenAI error body."),
        (
            REJECT,
            _answered(422, b'{"detail": "x"}'),
            "fail",
            "rejected with 422 but the body is not",
        ),
        (REJECT, _answered(400, b"bad request"), "fail", "but the body is not an OpenAI error"),
        (
            REJECT,
            _answered(400, b'{"error": "flat"}'),
            "fail",
            "but the body is not an OpenAI error",
        ),
        (REJECT, _answered(200, COMPLETION), "fail", "accepted with 200 a request that must be"),
        (REJECT, _answered(500, ERROR_BODY), "fail", "answered 500, a server error, where a 4xx"),
        (REJECT, _answered(302), "fail", "answered 302 where a 4xx was due."),
        (EITHER, _answered(200, COMPLETION), "pass", "accepted with 200 and a well-formed"),
        (EITHER, _answered(200, b"{}"), "fail", "the body is not a completion"),
        (EITHER, _answered(404, ERROR_BODY), "pass", "rejected with 404 and an OpenAI error body."),
        (EITHER, _answered(503, ERROR_BODY), "fail", "where a 4xx or a completion was due."),
        (LIMIT, _answered(431, b"Header too large"), "pass", "rejected with 431."),
        (LIMIT, _answered(200, COMPLETION), "fail", "must be rejected"),
        (LIMIT, HttpAnswer(Outcome.CLOSED, 1.0), "pass", "which this case allows."),
        (LIMIT_OR_OK, _answered(200, COMPLETION), "pass", "accepted with 200"),
        (
            REJECT,
            HttpAnswer(Outcome.CLOSED, 1.0),
            "fail",
            "closed the connection without answering.",
        ),
        (LIMIT, HttpAnswer(Outcome.TIMED_OUT, 10_000.0), "fail", "no answer within 10 s."),
        (REJECT, HttpAnswer(Outcome.UNREACHABLE, 1.0, detail="refused"), "fail", "(refused)"),
        (REJECT, HttpAnswer(Outcome.NOT_HTTP, 1.0, detail="junk"), "fail", "not HTTP (junk)"),
    ],
)
def test_judge(expect, answer, verdict, reason):
    got_verdict, got_reason = judge(expect, answer, timeout_s=10)
    assert got_verdict == verdict
    assert reason in got_reason
    assert got_reason.endswith(".")


# --- whole runs against test servers ----------------------------------------------------------


def test_a_well_behaved_server_passes_every_case_with_streams_unaffected():
    with serving(create_app()) as url:
        report = _probe(url + "/v1", timeout_s=5)
    assert [r.name for r in report.failed] == []
    assert report.passed and len(report.results) >= 40
    assert report.model == MODEL and report.health_path == "/health"
    assert report.reference_text == completion_text(REFERENCE_PROMPT, 8)
    assert all(r.health_after is HealthAfter.OK for r in report.results)
    assert report.streams.num_failed == 0 and report.streams.num_completed >= 2
    results = _by_name(report)
    # Declared either way, recorded which: this server ignores unknown fields.
    assert results["unknown-field"].status == 200
    assert results["max_tokens=NaN"].status == 400
    assert results["body-64mb"].status == 413 or results["body-64mb"].status is None
    as_json = json.loads(report.to_json())
    assert as_json["passed"] is True and as_json["num_cases"] == len(report.results)
    first = as_json["cases"][0]
    assert set(first) == {
        "name",
        "category",
        "request",
        "status",
        "body_excerpt",
        "verdict",
        "reason",
        "health_after",
        "latency_ms",
    }
    assert first["verdict"] == "pass" and first["category"] == "malformed-json"


def test_a_server_without_health_is_checked_through_the_model_list():
    with serving(create_app(has_health=False)) as url:
        report = _probe(url, only=frozenset({Category.METHODS}))
    assert report.health_path == "/v1/models"
    assert report.passed


def test_500s_for_wrong_types_fail_exactly_those_cases():
    with serving(create_app(Fault.ERROR_500_ON_WRONG_TYPE)) as url:
        report = _probe(url, only=frozenset({Category.WRONG_TYPES, Category.MISSING_FIELDS}))
    failed = {r.name: r for r in report.failed}
    assert "max-tokens-list" in failed and "message-role-unknown" in failed
    assert all(r.category is Category.WRONG_TYPES for r in failed.values())
    assert failed["prompt-number"].status == 500
    assert failed["prompt-number"].reason == "answered 500, a server error, where a 4xx was due."
    assert failed["prompt-number"].health_after is HealthAfter.OK
    assert _by_name(report)["no-prompt"].verdict is Verdict.PASS  # a missing field is a 400
    assert not report.passed and report.streams.passed


def test_a_hang_is_a_failed_case_and_the_probe_moves_on():
    with serving(create_app(Fault.HANG_ON_OBJECT_FIELD)) as url:
        report = _probe(url, timeout_s=1, only=frozenset({Category.UNKNOWN_FIELDS}))
    assert [r.name for r in report.failed] == ["unknown-field-object"]
    hung = report.failed[0]
    assert hung.reason == "no answer within 1 s." and hung.status is None
    assert hung.health_after is HealthAfter.OK and hung.latency_ms >= 1000
    assert report.streams.passed


def test_a_crash_fails_its_case_the_cases_after_it_and_the_streams():
    with serving(create_app(Fault.CRASH_ON_LIST_MAX_TOKENS)) as url:
        report = _probe(url, only=frozenset({Category.WRONG_TYPES}))
    names = [r.name for r in report.results]
    crash = names.index("max-tokens-list")
    assert all(r.verdict is Verdict.PASS for r in report.results[:crash])
    crashed = report.results[crash]
    assert crashed.reason.startswith(
        "closed the connection without answering; afterwards GET /health"
    )
    assert crashed.health_after is HealthAfter.DOWN
    after = report.results[crash + 1 :]
    assert after and all(r.verdict is Verdict.FAIL for r in after)
    assert after[0].reason == "not run: the server stopped answering after case 'max-tokens-list'."
    assert not report.streams.passed
    assert "max-tokens-list" in report.streams.failures[0].during


def test_a_probe_that_cannot_start_says_why():
    with pytest.raises(ProbeError, match="not an http"):
        ProbeConfig(url="ftp://127.0.0.1:1")
    with pytest.raises(ProbeError, match=r"Cannot reach .* \(connection refused\)"):
        _probe(f"http://127.0.0.1:{_closed_port()}")
    with serving(create_app()) as url, pytest.raises(ProbeError, match="answered 404"):
        _probe(url, model="another-model")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the CLI -------------------------------------------------------------------------------


def test_cli_exits_0_when_every_case_passes_and_writes_json(tmp_path):
    out = tmp_path / "probe.json"
    with serving(create_app()) as url:
        result = CliRunner().invoke(
            bad_input, ["--url", url, "--only", "methods", "--only", "limits", "--json", str(out)]
        )
    assert result.exit_code == 0, result.output
    assert "all 8 cases passed." in result.output
    written = json.loads(out.read_text())
    assert written["passed"] is True and len(written["cases"]) == 8


def test_cli_exits_1_and_names_the_failing_cases():
    with serving(create_app(Fault.HANG_ON_OBJECT_FIELD)) as url:
        result = CliRunner().invoke(
            bad_input,
            ["--url", url, "--only", "unknown-fields", "--timeout", "1"],
            env={"COLUMNS": "200"},
        )
    assert result.exit_code == 1, result.output
    assert "1 of 4 cases failed: unknown-field-object." in result.output
    assert "no answer within 1 s." in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "not-a-url"], "is not an http(s) URL"),
        (["--url", "http://127.0.0.1:1", "--timeout", "0"], "--timeout must be positive"),
        (["--url", "http://127.0.0.1:{closed}"], "Cannot reach"),
        (["--url", "http://127.0.0.1:1", "--only", "nonsense"], "Invalid value for '--only'"),
        ([], "Missing option '--url'"),
    ],
)
def test_cli_usage_errors_exit_2_in_one_sentence(args, message):
    args = [a.replace("{closed}", str(_closed_port())) for a in args]
    result = CliRunner().invoke(bad_input, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


# --- the console table ------------------------------------------------------------------------

GOLDEN_TABLE = """\
bad-input probe of http://h:1 (m)
┏━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━━━┳━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓
┃ case         ┃ category       ┃ status ┃ verdict ┃   ms ┃ reason                             ┃
┡━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━╇━━━━━━━━╇━━━━━━━━━╇━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩
│ empty-body   │ malformed-json │    400 │ pass    │    2 │ rejected with 400 and an OpenAI    │
│              │                │        │         │      │ error body.                        │
│ header-100kb │ limits         │      - │ fail    │ 1000 │ no answer within 1 s.              │
└──────────────┴────────────────┴────────┴─────────┴──────┴────────────────────────────────────┘
background streams: 2, 7 requests answered with the reference text, 1 failed, longest 12 ms.
  a background stream answered 503 (during: header-100kb)
1 of 2 cases failed: header-100kb.
"""


# The default view, at 80 columns: passes and failures per category, then the failing cases.
GOLDEN_SUMMARY = """\
bad-input probe of http://h:1 (m)
┏━━━━━━━━━━━━━━━━┳━━━━━━━┳━━━━━━━━┳━━━━━━━━┓
┃ category       ┃ cases ┃ passed ┃ failed ┃
┡━━━━━━━━━━━━━━━━╇━━━━━━━╇━━━━━━━━╇━━━━━━━━┩
│ malformed-json │     1 │      1 │      0 │
│ limits         │     1 │      0 │      1 │
└────────────────┴───────┴────────┴────────┘
failed cases
┏━━━━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━━━┳━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━┓
┃ case         ┃ status ┃ verdict ┃   ms ┃ reason                   ┃
┡━━━━━━━━━━━━━━╇━━━━━━━━╇━━━━━━━━━╇━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━┩
│ header-100kb │      - │ fail    │ 1000 │ no answer within 1 s.    │
└──────────────┴────────┴─────────┴──────┴──────────────────────────┘
background streams: 2, 7 requests answered with the reference text, 1 failed,
longest 12 ms.
  a background stream answered 503 (during: header-100kb)
1 of 2 cases failed: header-100kb.
"""


def test_the_console_table_matches_the_golden_text():
    def result(name, category, status, verdict, reason, latency_ms):
        return CaseResult(
            name,
            category,
            "POST /v1/completions: x (1 B)",
            status,
            "",
            verdict,
            reason,
            HealthAfter.OK,
            latency_ms,
        )

    report = ProbeReport(
        url="http://h:1",
        model="m",
        health_path="/health",
        reference_text="ok",
        results=(
            result(
                "empty-body",
                Category.MALFORMED_JSON,
                400,
                Verdict.PASS,
                "rejected with 400 and an OpenAI error body.",
                2.2,
            ),
            result(
                "header-100kb", Category.LIMITS, None, Verdict.FAIL, "no answer within 1 s.", 1000.4
            ),
        ),
        streams=StreamsResult(
            2, 7, 1, (StreamFailure("a background stream answered 503", ("header-100kb",)),), 12.0
        ),
    )
    assert _rendered(report, width=96, all_cases=True) == GOLDEN_TABLE
    assert _rendered(report, width=80) == GOLDEN_SUMMARY


def _rendered(report: ProbeReport, *, width: int, **options) -> str:
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(render_report(report, **options))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


# --- the reference server (slow) ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_reference_server_on_tiny_random(tmp_path: Path):
    port_file = tmp_path / "port"
    log = (tmp_path / "server.log").open("wb")
    command = [sys.executable, "-m", "engine_ref.serving", "--model", "tiny-random"]
    command += ["--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the reference server did not start in 120 s"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        # 30 s, not 10: the suite shares a few CPU cores with the server's engine thread.
        report = _probe(url, timeout_s=30)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    assert len(report.results) >= 40
    assert report.model == "tiny-random"
    failures = {r.name: r.reason for r in report.failed}
    assert not failures and report.streams.passed, (failures, report.streams)
