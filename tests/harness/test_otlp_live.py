"""`bench run --otlp URL`: a run's spans pushed live to an OTLP/HTTP collector.

A fake collector (aiohttp on loopback, in a thread) decodes every POST with the
OpenTelemetry protobuf classes (`json_format.Parse` into `ExportTraceServiceRequest`, the
hex ids converted as an OTLP/JSON receiver does). The runs go through `bench run --url
<mock> --otlp <collector>`: the spans it receives are the spans `bench export --format
otlp-json` writes for the same run directory; a 503 is retried; a collector that is down,
slow or refusing never fails the run, and the manifest counts what was dropped. The queue's
bound is checked at, below and above it on the sink itself (no timing thresholds).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import sys
import threading
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import bench
from harness.cli import compose as compose_module
from harness.cli.main import main
from harness.targets.mock_server import MockConfig, start_mock
from reports.cli_export import export
from reports.exports.otlp_live import OtlpPush, PushError, parse_endpoint
from slo.runrecord import RequestRecord, RunManifest, open_run

web = pytest.importorskip("aiohttp.web")
json_format = pytest.importorskip("google.protobuf.json_format")
trace_service = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="opentelemetry-proto is in the test extra",
)

N_REQUESTS = 4
ARGS = ["--workload", "random", "--tokenizer", "tiny-random", "--input-len", "4",
        "--output-len", "3", "--num-requests", str(N_REQUESTS), "--quiet"]  # fmt: skip


def _decode(doc: dict):
    """An OTLP/JSON body as the protobuf request (hex ids to base64 first): raises when the
    body is not a valid `ExportTraceServiceRequest`."""
    doc = json.loads(json.dumps(doc))
    for resource in doc["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return json_format.Parse(json.dumps(doc), trace_service.ExportTraceServiceRequest())


class Collector:
    """A fake OTLP/HTTP collector: answers `statuses` in turn (then 200), each after
    `delay_s`; keeps every accepted body (decoded) and every request's status and headers."""

    def __init__(self, statuses=(), delay_s: float = 0.0) -> None:
        self.statuses, self.delay_s = list(statuses), delay_s
        self.answered: list[int] = []
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.content_types: list[str] = []

    async def traces(self, request):
        body = await request.read()
        self.headers.append(request.headers.copy())  # case-insensitive
        self.content_types.append(request.content_type)
        status = self.statuses.pop(0) if self.statuses else 200
        self.answered.append(status)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if status == 200:
            doc = json.loads(body)
            _decode(doc)  # the real decoder reads it, or the test errs here
            self.bodies.append(doc)
        return web.json_response({}, status=status)

    def spans(self) -> list[dict]:
        return [s for d in self.bodies for s in d["resourceSpans"][0]["scopeSpans"][0]["spans"]]


@contextlib.contextmanager
def served(start):
    """Run `start()` (a coroutine that starts an aiohttp server and returns (runner, url))
    on an event loop of its own thread; yield the url, clean up after."""
    loop = asyncio.new_event_loop()
    runner, url = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def collector_at(collector: Collector):
    """Serve `collector` on a free loopback port; yield its base URL."""

    async def start():
        app = web.Application()
        app.router.add_post("/v1/traces", collector.traces)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"

    return served(start)


@pytest.fixture(scope="module")
def mock_url():
    """The mock engine in this process (a thread), so no server process is started."""
    with served(lambda: start_mock(MockConfig(ttft_ms=1, itl_ms=1))) as url:
        yield url


def _run(mock_url: str, out: Path, *extra: str):
    result = CliRunner().invoke(bench, ["run", "--url", mock_url, *ARGS, "--out", str(out), *extra])
    assert result.exit_code == 0, (result.output, result.exception)
    return result, json.loads((out / "manifest.json").read_text())


def _by_id(spans: list[dict]) -> dict[str, dict]:
    return {s["spanId"]: s for s in spans}


@pytest.fixture(scope="module")
def pushed(mock_url, tmp_path_factory):
    """One run pushed to a collector that answers 503 once, then 200."""
    collector = Collector(statuses=[503])
    out = tmp_path_factory.mktemp("otlp") / "run"
    with collector_at(collector) as url:
        result, manifest = _run(mock_url, out, "--otlp", url, "--otlp-header", "x-token: s3cret")
    return collector, out, manifest, result


def test_the_pushed_spans_are_the_export_s(pushed):
    """Span for span (ids, times, events, attributes), the resource and the scope: the
    collector got what `bench export --format otlp-json` writes for the run directory."""
    collector, out, _, _ = pushed
    exported = json.loads(CliRunner().invoke(export, [str(out), "--format", "otlp-json"]).output)
    export_spans = exported["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert _by_id(collector.spans()) == _by_id(export_spans)
    assert len(collector.spans()) == len(export_spans)  # no span pushed twice
    for body in collector.bodies:
        assert body["resourceSpans"][0]["resource"] == exported["resourceSpans"][0]["resource"]
        assert (body["resourceSpans"][0]["scopeSpans"][0]["scope"]
                == exported["resourceSpans"][0]["scopeSpans"][0]["scope"])  # fmt: skip


def test_one_span_per_request_at_the_recorded_times_and_the_root(pushed):
    """Worked by hand from the run directory: a request span starts at started_at + its
    t_sent_ns and ends at started_at + its t_done_ns; the root span says 4 requests."""
    collector, out, manifest, _ = pushed
    tables = open_run(out)
    started = datetime.strptime(manifest["started_at"], "%Y-%m-%dT%H:%M:%S%z")
    t0_unix_ns = int(started.timestamp()) * 1_000_000_000
    spans = collector.spans()
    requests = {
        next(a["value"]["stringValue"] for a in s["attributes"] if a["key"] == "llm_bench.request_id"): s
        for s in spans
        if s["kind"] == 3
    }  # fmt: skip
    rows = tables.requests.to_pylist()
    assert len(rows) == N_REQUESTS and sorted(requests) == sorted(r["request_id"] for r in rows)
    for row in rows:
        span = requests[row["request_id"]]
        assert int(span["startTimeUnixNano"]) == t0_unix_ns + row["t_sent_ns"]
        assert int(span["endTimeUnixNano"]) == t0_unix_ns + row["t_done_ns"]
    (root,) = [s for s in spans if "parentSpanId" not in s]
    assert {s["traceId"] for s in spans} == {root["traceId"]}
    assert {s["parentSpanId"] for s in requests.values()} == {root["spanId"]}
    attrs = {a["key"]: a["value"] for a in root["attributes"]}
    assert attrs["llm_bench.requests.total"] == {"intValue": str(N_REQUESTS)}
    # each request: its span and its time-to-first-token child; and the root
    assert len(spans) == 2 * N_REQUESTS + 1


def test_a_503_is_retried_and_the_manifest_counts_every_span(pushed):
    collector, _, manifest, result = pushed
    assert collector.answered[:2] == [503, 200]
    assert manifest["otlp"] == {
        "endpoint": collector_url(collector, manifest),
        "spans_sent": 2 * N_REQUESTS + 1,
        "spans_dropped": 0,
        "batches_failed": 0,
        "last_error": None,
    }
    assert "OTLP" not in result.output  # nothing dropped: no sentence
    assert set(collector.content_types) == {"application/json"}


def collector_url(collector: Collector, manifest: dict) -> str:
    """The recorded endpoint: the collector's traces URL (read back, then checked in shape)."""
    shown = manifest["otlp"]["endpoint"]
    assert shown.startswith("http://127.0.0.1:") and shown.endswith("/v1/traces")
    return shown


def test_the_header_is_sent_and_never_recorded(pushed):
    collector, out, _, _ = pushed
    assert {h.get("x-token") for h in collector.headers} == {"s3cret"}
    for name in ("manifest.json", "summary.json"):
        assert "s3cret" not in (out / name).read_text()


def test_no_secret_reaches_the_manifest_s_command_line(mock_url, tmp_path, monkeypatch):
    """The header's value and the URL's password and query are sent, and the recorded
    command line (`manifest.json`'s `command_line`, from sys.argv) has none of them."""
    collector = Collector()
    with collector_at(collector) as url:
        secret_url = url.replace("http://", "http://me:pw@") + "/?token=t0k"
        extra = ["--otlp", secret_url, "--otlp-header", "x-token: s3cret"]
        argv = ["bench", "run", "--url", mock_url, *ARGS, "--out", str(tmp_path / "run"), *extra]
        monkeypatch.setattr(sys, "argv", argv)
        _, manifest = _run(mock_url, tmp_path / "run", *extra)
    assert collector.headers[0]["x-token"] == "s3cret"
    assert collector.headers[0]["Authorization"] == "Basic " + base64.b64encode(b"me:pw").decode()
    text = (tmp_path / "run" / "manifest.json").read_text()
    assert "s3cret" not in text and "me:pw" not in text and "t0k" not in text
    line = manifest["command_line"]
    assert line[line.index("--otlp-header") + 1] == "<redacted>"
    assert line[line.index("--otlp") + 1] == url + "/"  # as given, less the credentials and query


@pytest.mark.parametrize(
    ("argv", "recorded"),
    [
        (["--otlp-header", "a: b", "--x"], ["--otlp-header", "<redacted>", "--x"]),
        (["--otlp-header=a: b"], ["--otlp-header=<redacted>"]),
        (
            ["--api-key", "k", "--header", "X: y"],
            ["--api-key", "<redacted>", "--header", "<redacted>"],
        ),
        (["--otlp", "http://u:p@h:1/x?t=1"], ["--otlp", "http://h:1/x"]),
        (["--otlp=https://h/"], ["--otlp=https://h/"]),
    ],
)
def test_the_recorded_command_line(argv, recorded):
    from harness.run.environment import recorded_command_line

    assert recorded_command_line(argv) == recorded


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_collector_that_is_down_leaves_the_run_whole(mock_url, tmp_path):
    """Nothing listens: every batch fails after its retries; exit 0, all spans dropped,
    one sentence on the console."""
    result, manifest = _run(
        mock_url, tmp_path / "run", "--otlp", f"http://127.0.0.1:{_free_port()}"
    )
    otlp = manifest["otlp"]
    assert otlp["spans_sent"] == 0 and otlp["spans_dropped"] == 2 * N_REQUESTS + 1
    assert otlp["batches_failed"] >= 1 and otlp["last_error"]
    assert manifest["complete"] is True
    assert "the OTLP push to http://127.0.0.1:" in result.output


def test_a_slow_collector_drops_beyond_the_bound_and_never_holds_the_run(
    mock_url, tmp_path, monkeypatch
):
    """A queue of 4 spans, batches of 2, each POST answered 0.3 s late, and at most 0.5 s
    waited at the end: the run ends (exit 0); the spans that did not fit are dropped and
    counted; sent + dropped is every span; the queue never held more than 4 + the root."""
    pushes = []
    original = compose_module.otlp_sink

    def small(endpoint):
        factory = original(endpoint, max_queue_spans=4, batch_spans=2, drain_s=0.5)
        return lambda manifest, run_dir: pushes.append(factory(manifest, run_dir)) or pushes[-1]

    monkeypatch.setattr(compose_module, "otlp_sink", small)
    with collector_at(Collector(delay_s=0.3)) as url:
        result, manifest = _run(mock_url, tmp_path / "run", "--otlp", url)
    otlp = manifest["otlp"]
    assert otlp["spans_sent"] + otlp["spans_dropped"] == 2 * N_REQUESTS + 1
    assert otlp["spans_dropped"] >= 1
    (push,) = pushes
    assert push.max_queued_spans <= 4 + 1
    assert "dropped" in result.output


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("ftp://127.0.0.1:4318", "not an http(s) URL"),
        ("http://", "not an http(s) URL"),
        ("127.0.0.1:4318", "not an http(s) URL"),
        ("http://127.0.0.1:99999", "not a URL"),
    ],
)
def test_a_bad_otlp_url_is_one_sentence_and_exit_2(url, words, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench", "run", "--url", "http://127.0.0.1:9/v1",
                                      "--otlp", url])  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_a_header_without_a_colon_or_without_otlp_is_refused():
    with pytest.raises(Exception, match="not 'Name: value'"):
        parse_endpoint("http://127.0.0.1:4318", ("x-token s3cret",))
    result = CliRunner().invoke(bench, ["run", "--otlp-header", "a: b", "--num-requests", "1"])
    assert "give --otlp URL too" in str(result.exception)


def test_the_recorded_endpoint_has_no_credentials():
    endpoint = parse_endpoint("https://me:pw@collector.example:4318/otlp/?token=t")
    assert endpoint.shown == "https://collector.example:4318/otlp/v1/traces"
    assert endpoint.traces_url == "https://collector.example:4318/otlp/v1/traces?token=t"
    assert dict(endpoint.headers)["Authorization"] == "Basic " + base64.b64encode(b"me:pw").decode()
    assert parse_endpoint("http://h:1/v1/traces").traces_url == "http://h:1/v1/traces"


# The sink itself: the queue's bound, retries and refusals, with a fake POST -----------------

MANIFEST = RunManifest(run_id="r", started_at="2026-11-29T10:00:00+00:00", t0_ns=0)


class FakePost:
    """Answers with `errors` in turn (then success) and counts the spans it was given."""

    def __init__(self, errors=()) -> None:
        self.errors, self.calls, self.spans = list(errors), 0, 0

    def __call__(self, endpoint, body: bytes, timeout_s: float) -> int:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        self.spans += len(json.loads(body)["resourceSpans"][0]["scopeSpans"][0]["spans"])
        return 0


def _push(post, **limits) -> OtlpPush:
    # a long interval and a large batch: nothing is sent before `close`
    limits = {"interval_s": 60.0, "batch_spans": 100, "drain_s": 10.0, **limits}
    return OtlpPush(parse_endpoint("http://127.0.0.1:9"), MANIFEST, Path("r"), post=post, **limits)


def _records(n: int) -> list[RequestRecord]:
    """`n` sent requests without a token: one span each."""
    return [RequestRecord(request_id=f"q{i}", t_sent_ns=i, t_done_ns=i + 10, status="ok")
            for i in range(n)]  # fmt: skip


@pytest.mark.parametrize(("offered", "dropped"), [(3, 0), (4, 0), (5, 1), (9, 5)])
def test_the_queue_holds_at_most_its_bound(offered, dropped):
    """Bound 4 spans: 3 and 4 fit, the 5th and later are dropped; the root span always goes."""
    post = FakePost()
    push = _push(post, max_queue_spans=4)
    push.add(_records(offered), {})
    assert push.max_queued_spans == offered - dropped
    push.close(complete=True)
    otlp = push.manifest_changes()["otlp"]
    assert (otlp["spans_sent"], otlp["spans_dropped"]) == (offered - dropped + 1, dropped)
    assert post.spans == offered - dropped + 1
    assert (push.warning() is None) == (dropped == 0)


def test_a_request_with_a_first_token_is_two_spans_and_an_unsent_one_none():
    push = _push(FakePost(), max_queue_spans=3)
    records = [RequestRecord(request_id="a", t_sent_ns=1, t_first_token_ns=5, t_done_ns=9),
               RequestRecord(request_id="b", t_scheduled_ns=2),  # never sent: no span
               RequestRecord(request_id="c", t_sent_ns=3, t_first_token_ns=6, t_done_ns=8)]  # fmt: skip
    push.add(records, {"a": 4})
    push.close(complete=False)
    otlp = push.manifest_changes()["otlp"]
    assert (otlp["spans_sent"], otlp["spans_dropped"]) == (2 + 1, 2)  # c's two did not fit
    assert (push.tally.total, push.tally.not_sent, push.tally.last_end) == (3, 1, 9)


@pytest.mark.parametrize(
    ("errors", "calls", "failed"),
    [
        ([PushError("HTTP 503", retryable=True)] * 2, 3, 0),  # two retries: the third goes
        ([PushError("HTTP 503", retryable=True)] * 3, 3, 1),  # retries spent: the batch fails
        ([PushError("HTTP 400", retryable=False)], 1, 1),  # a refusal is not retried
    ],
)
def test_retries_are_bounded_and_a_refusal_is_not_retried(errors, calls, failed):
    post = FakePost(errors)
    push = _push(post)
    push.add(_records(2), {})
    push.close(complete=True)
    otlp = push.manifest_changes()["otlp"]
    assert post.calls == calls and otlp["batches_failed"] == failed
    assert otlp["spans_sent"] + otlp["spans_dropped"] == 3
    assert (otlp["last_error"] is None) == (failed == 0)
