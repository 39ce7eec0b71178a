"""The Responses and Messages APIs on the client side (`harness.http.events`): request bodies
and headers, the typed-event parsers against hand-written streams, the records they make, and
the mock's answers of both APIs (faults included) through the real client path."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import bench
from harness.errors import HarnessError
from harness.http.client import (
    AiohttpTransport,
    ClientOptions,
    RequestPayload,
    body_fields,
    build_body,
    make_session,
)
from harness.http.events import parse_typed_body, parse_typed_stream
from harness.load.loadgen import LoadPlan, run_load
from harness.load.records import RecordContext, to_rows
from harness.run.config import RunConfig
from harness.run.plan import session_plan
from harness.targets.mock_server import MockConfig, start_mock
from slo.runrecord import Endpoint, ErrorClass, TokenSource

R, M = Endpoint.RESPONSES, Endpoint.MESSAGES
SPEC = {"prompt": "Hi there", "max_output_tokens": 5, "temperature": 0.5, "seed": 3,
        "tenant": "acme", "ignore_eos": True}  # fmt: skip


def _options(endpoint, **kw) -> ClientOptions:
    return ClientOptions(base_url="http://x/v1", model="m", endpoint=endpoint, **kw)


# --- bodies and headers -------------------------------------------------------------------------


def test_request_bodies_use_each_apis_field_names():
    assert body_fields(_options(R), SPEC) == {
        "model": "m", "input": "Hi there", "max_output_tokens": 5, "stream": True,
        "ignore_eos": True, "temperature": 0.5, "seed": 3, "user": "acme",
    }  # fmt: skip
    assert body_fields(_options(M, stream=False, extra_body={"top_k": 2}), SPEC) == {
        "model": "m", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5,
        "ignore_eos": True, "temperature": 0.5, "seed": 3, "metadata": {"user_id": "acme"},
        "top_k": 2,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        (M, {"x-api-key": "k", "anthropic-version": "2023-06-01"}),
        (R, {"Authorization": "Bearer k"}),
        (Endpoint.CHAT, {"Authorization": "Bearer k"}),
    ],
)
def test_messages_send_the_key_as_x_api_key_and_no_bearer(endpoint, expected):
    async def headers():
        options = _options(endpoint, api_key="k", headers=(("x-extra", "1"),))
        async with make_session(options, max_connections=1) as session:
            return dict(session.headers)

    got = asyncio.run(headers())
    auth = {
        k: v
        for k, v in got.items()
        if k.lower() in ("authorization", "x-api-key", "anthropic-version")
    }
    assert auth == expected and got["x-extra"] == "1"


# --- the parsers --------------------------------------------------------------------------------


def _reads(*events, t0=100) -> list[tuple[int, bytes]]:
    """One read per event at t0, t0 + 1, ...; `event: <type>` then its JSON."""
    return [
        (t0 + i, f"event: {e.get('type', 'x')}\ndata: {json.dumps(e)}\n\n".encode())
        for i, e in enumerate(events)
    ]


RESPONSES_STREAM = (
    {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
    {"type": "response.output_item.added", "output_index": 0},
    {"type": "response.output_text.delta", "delta": "Hel"},
    {"type": "response.output_text.delta", "delta": "lo"},
    {"type": "response.output_text.done", "text": "Hello"},
    {"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "usage": {
        "input_tokens": 7, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 9}}},
)  # fmt: skip
MESSAGES_STREAM = (
    {"type": "message_start", "message": {"id": "msg_1", "usage": {
        "input_tokens": 10, "cache_read_input_tokens": 5, "cache_creation_input_tokens": 2,
        "output_tokens": 1}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "ping"},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}},
    {"type": "message_stop"},
)  # fmt: skip


def test_a_responses_stream_parses_text_usage_and_chunk_times():
    parsed = parse_typed_stream(_reads(*RESPONSES_STREAM), R)
    assert parsed.error_class is None
    assert parsed.text == "Hello" and parsed.response_id == "resp_1"
    assert parsed.finish_reason == "completed"
    assert parsed.usage == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                            "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    assert parsed.t_ns.tolist() == [100, 101, 102, 103, 104, 105]
    assert parsed.n_tokens.tolist() == [0, 0, 1, 1, 0, 0]  # the deltas only, not the done text
    assert parsed.n_chars.tolist() == [0, 0, 3, 2, 0, 0]
    assert parsed.chunk_tokens_source is TokenSource.CHUNK_COUNT


def test_a_messages_stream_parses_text_deltas_only_and_anthropic_usage():
    parsed = parse_typed_stream(_reads(*MESSAGES_STREAM), M)
    assert parsed.error_class is None and parsed.text == "Hi!"
    assert parsed.finish_reason == "end_turn" and parsed.response_id == "msg_1"
    # prompt = input 10 + cache read 5 + cache creation 2; output from message_delta
    assert parsed.usage == {"prompt_tokens": 17, "completion_tokens": 3, "total_tokens": 20,
                            "prompt_tokens_details": {"cached_tokens": 5}}  # fmt: skip
    assert parsed.t_ns.tolist() == [100, 101, 103, 104, 105, 106, 107, 108]  # no ping (102)
    assert parsed.n_tokens.tolist() == [0, 0, 1, 0, 1, 0, 0, 0]


def test_an_incomplete_response_is_terminal_with_its_reason():
    last = {"type": "response.incomplete", "response": {
        "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
        "usage": {"input_tokens": 3, "output_tokens": 1}}}  # fmt: skip
    parsed = parse_typed_stream(_reads(RESPONSES_STREAM[2], last), R)
    assert parsed.error_class is None and parsed.finish_reason == "max_output_tokens"
    assert parsed.usage["completion_tokens"] == 1


@pytest.mark.parametrize(
    ("endpoint", "events", "error_class", "message"),
    [
        (R, RESPONSES_STREAM[:-1], ErrorClass.INCOMPLETE_STREAM,
         "the stream ended before response.completed or response.incomplete"),
        (M, MESSAGES_STREAM[:-1], ErrorClass.INCOMPLETE_STREAM, "the stream ended before message_stop"),
        (R, (*RESPONSES_STREAM[:3], {"type": "response.failed", "response": {
            "status": "failed", "error": {"code": "server_error", "message": "engine died"}}}),
         ErrorClass.STREAM_ERROR, "engine died"),
        (R, (RESPONSES_STREAM[2], {"type": "error", "code": "x", "message": "rate limited"}),
         ErrorClass.STREAM_ERROR, "rate limited"),
        (M, (*MESSAGES_STREAM[:4], {"type": "error", "error": {"type": "overloaded_error",
                                                              "message": "Overloaded"}}),
         ErrorClass.STREAM_ERROR, "Overloaded"),
        (M, (MESSAGES_STREAM[0], {"index": 0}), ErrorClass.MALFORMED_JSON, "an event has no type"),
        (R, (*RESPONSES_STREAM, RESPONSES_STREAM[2]), ErrorClass.MALFORMED_SSE,
         "the stream sent data after its last event"),
        (R, ({"type": "response.output_text.delta", "delta": 5},), ErrorClass.MALFORMED_JSON,
         "an event's text is not a string"),
    ],
)  # fmt: skip
def test_broken_typed_streams_are_classified(endpoint, events, error_class, message):
    parsed = parse_typed_stream(_reads(*events), endpoint)
    assert (parsed.error_class, parsed.error_message) == (error_class, message)


def test_a_stream_cut_inside_an_event_or_not_json():
    cut = _reads(*RESPONSES_STREAM)
    cut[-1] = (cut[-1][0], cut[-1][1][:-30])
    assert parse_typed_stream(cut, R).error_class is ErrorClass.INCOMPLETE_STREAM
    bad = [*_reads(*RESPONSES_STREAM[:2]), (9, b"event: x\ndata: {not json\n\n")]
    assert parse_typed_stream(bad, R).error_class is ErrorClass.MALFORMED_JSON


@pytest.mark.parametrize(
    ("endpoint", "body", "text", "finish", "usage", "error"),
    [
        (R, {"id": "resp_2", "status": "completed", "output": [
            {"type": "reasoning", "content": []},
            {"type": "message", "content": [{"type": "output_text", "text": "A"},
                                            {"type": "refusal", "refusal": "no"},
                                            {"type": "output_text", "text": "B"}]}],
             "usage": {"input_tokens": 4, "output_tokens": 2}},
         "AB", "completed", {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}, None),
        (M, {"id": "msg_2", "type": "message", "content": [{"type": "text", "text": "Yo"}],
             "stop_reason": "max_tokens", "usage": {"input_tokens": 3, "output_tokens": 1}},
         "Yo", "max_tokens", {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}, None),
        (M, {"type": "error", "error": {"type": "api_error", "message": "boom"}},
         "", None, None, (ErrorClass.STREAM_ERROR, "boom")),
        (R, {"id": "resp_3", "status": "failed", "error": {"message": "bad"}},
         "", None, None, (ErrorClass.STREAM_ERROR, "bad")),
        (R, {"id": "resp_4", "status": "completed"}, "", None, None,
         (ErrorClass.MALFORMED_JSON, "the response lacks an output list")),
    ],
)  # fmt: skip
def test_whole_bodies_of_both_apis(endpoint, body, text, finish, usage, error):
    parsed = parse_typed_body(json.dumps(body).encode(), endpoint)
    assert (parsed.error_class, parsed.error_message) == (error or (None, None))
    assert (parsed.text, parsed.finish_reason, parsed.usage) == (text, finish, usage)


def test_records_take_the_mapped_usage_and_first_token_time():
    raw_reads = _reads(*MESSAGES_STREAM, t0=1_000)

    @dataclasses.dataclass
    class Raw:  # the fields `to_rows` reads of a RawResult
        request_id: str = "r0"
        is_warmup: bool = False
        t_scheduled_ns: int = 990
        t_sent_ns: int = 995
        t_first_byte_ns: int = 999
        t_done_ns: int = 1_010
        http_status: int = 200
        reads: list = dataclasses.field(default_factory=lambda: raw_reads)
        body: bytes | None = None
        status: object = None
        error_class: object = None
        error_message: object = None
        engine_request_id: object = None
        worker: object = None

    ctx = RecordContext(t0_ns=900, is_chat=False, endpoint=M)
    record, chunks = to_rows(Raw(), 12, ctx)
    assert record.status == "ok" and record.finish_reason == "end_turn"
    assert (record.usage_prompt_tokens, record.usage_completion_tokens) == (17, 3)
    assert record.usage_cached_tokens == 5 and record.output_tokens == 3
    assert record.t_first_token_ns == 1_003 - 900 and record.t_last_token_ns == 1_005 - 900
    assert record.response_id == "msg_1" and len(chunks) == 8


# --- multi-turn sessions ------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", [R, M])
def test_multi_turn_sessions_are_refused_in_one_sentence(endpoint):
    config = RunConfig(url="http://x/v1", tokenizer="tiny-random")
    with pytest.raises(
        HarnessError, match=r"^--endpoint \w+ sends single-turn requests; .*use --endpoint chat\.$"
    ):
        session_plan(config, None, _options(endpoint), [], [], None)


# --- the mock, through the real client ----------------------------------------------------------


async def _drive(config: MockConfig, endpoint, *, stream=True, api_key=None, n=2):
    runner, url = await start_mock(config)
    try:
        options = ClientOptions(base_url=url, model="mock", endpoint=endpoint, stream=stream,
                                api_key=api_key, timeout_s=10)  # fmt: skip
        spec = {"prompt": "a b c", "max_output_tokens": 6}
        plan = LoadPlan(
            [RequestPayload(f"r{i}", build_body(options, spec)) for i in range(n)], [0.0] * n
        )
        results, t0 = [], {}
        async with AiohttpTransport(options, max_connections=n) as transport:
            await run_load(
                transport, plan, results.append, start_callback=lambda t: t0.setdefault("t", t)
            )
        ctx = RecordContext(t0_ns=t0["t"], is_chat=False, endpoint=endpoint)
        return [dataclasses.asdict(to_rows(raw, 3, ctx)[0]) for raw in results]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("endpoint", [R, M])
@pytest.mark.parametrize("stream", [True, False])
def test_the_mock_answers_both_apis_with_its_key_and_usage(endpoint, stream):
    rows = asyncio.run(
        _drive(MockConfig(ttft_ms=1, itl_ms=1, api_key="k"), endpoint, stream=stream, api_key="k")
    )
    for row in rows:
        assert row["status"] == "ok", row
        assert (row["usage_prompt_tokens"], row["usage_completion_tokens"]) == (3, 6)
        assert row["finish_reason"] == ("max_output_tokens" if endpoint is R else "max_tokens")
        assert row["output_chars"] == len(" t0 t1 t2 t3 t4 t5") and row["output_flags"] is None
        assert row["num_chunks"] == ((4 + 6 + 4) if endpoint is R else (2 + 6 + 3)) if stream else 1


@pytest.mark.parametrize("endpoint", [R, M])
@pytest.mark.parametrize(
    ("fault", "status", "error_class"),
    [
        ("error_rate", "error", "http_5xx"),
        ("reject_rate", "rejected", "rejected_429"),
        ("reset_rate", "unknown", "connection_reset"),
        ("incomplete_rate", "unknown", "incomplete_stream"),
        ("malformed_sse_rate", "error", "malformed_sse"),
        ("malformed_json_rate", "error", "malformed_json"),
    ],
)
def test_the_mocks_faults_are_classified_on_both_apis(endpoint, fault, status, error_class):
    rows = asyncio.run(_drive(MockConfig(ttft_ms=1, itl_ms=1, **{fault: 1.0}), endpoint, n=1))
    assert [(r["status"], r["error_class"]) for r in rows] == [(status, error_class)]


# --- `bench run` against the mock: the truth bands ----------------------------------------------


def _measured_ms(run_dir) -> tuple[float, float]:
    """Median TTFT (send to first token-bearing event) and median gap between token-bearing
    events, in ms, from the run's tables."""
    req = pq.read_table(run_dir / "requests.parquet").to_pydict()
    ttft_ms = (np.array(req["t_first_token_ns"]) - np.array(req["t_sent_ns"])) / 1e6
    chunks = pq.read_table(run_dir / "chunks.parquet").to_pydict()
    by_request: dict[str, list[int]] = {}
    for rid, t_ns, n in zip(chunks["request_id"], chunks["t_ns"], chunks["n_tokens"], strict=True):
        if n > 0:
            by_request.setdefault(rid, []).append(t_ns)
    gaps = [g for times in by_request.values() for g in np.diff(times) / 1e6]
    return float(np.median(ttft_ms)), float(np.median(gaps))


@pytest.mark.serial
def test_bench_run_measures_the_mocks_ttft_and_itl_on_both_apis(mock_server, tmp_path):
    """Mock at TTFT 50 ms, ITL 10 ms, 30 requests at 20/s per API through `bench run`. The
    median TTFT, less the loopback round trip measured the same way against a mock that
    answers at once (about 1 ms here, plus asyncio's late wake-up), is within +/-2 ms of 50 and
    never below it; the median gap between token events within +/-2 ms of 10. A wrong clock,
    a unit slip or an event counted twice falls outside."""

    def run(url: str, endpoint: str, out) -> tuple[float, float]:
        argv = ["run", "--url", url, "--tokenizer", "tiny-random", "--workload", "random",
                "--input-len", "8", "--output-len", "8", "--num-requests", "30",
                "--request-rate", "20", "--endpoint", endpoint, "--out", str(out), "--quiet"]  # fmt: skip
        result = CliRunner().invoke(bench, argv)
        assert result.exit_code == 0, result.output
        req = pq.read_table(out / "requests.parquet").to_pydict()
        assert req["status"] == ["ok"] * 30
        assert req["usage_completion_tokens"] == [8] * 30
        assert req["output_flags"] == [None] * 30  # usage agrees with the 8 events streamed
        return _measured_ms(out)

    with mock_server("--ttft-ms", "0", "--itl-ms", "0") as url:  # the same loopback for both
        round_trip_ms, _ = run(url, "responses", tmp_path / "round-trip")
    for endpoint in ("responses", "messages"):
        with mock_server("--ttft-ms", "50", "--itl-ms", "10") as url:
            ttft_ms, itl_ms = run(url, endpoint, tmp_path / endpoint)
        assert ttft_ms >= 50, (endpoint, ttft_ms)
        assert abs(ttft_ms - round_trip_ms - 50) <= 2, (endpoint, ttft_ms, round_trip_ms)
        assert abs(itl_ms - 10) <= 2, (endpoint, itl_ms)
