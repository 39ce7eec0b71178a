"""Every error class is produced by the mock and classified; no request goes missing."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest

from harness.http.client import AiohttpTransport, ClientOptions, RequestPayload, build_body
from harness.load.loadgen import LoadPlan, run_load
from harness.load.records import RecordContext, to_rows
from harness.targets.mock_server import MockConfig, start_mock


def _payloads(options: ClientOptions, n: int, max_tokens: int = 8) -> list[RequestPayload]:
    spec = {"prompt": "a b c", "max_output_tokens": max_tokens, "ignore_eos": True}
    return [RequestPayload(f"r{i}", build_body(options, spec)) for i in range(n)]


async def _drive(
    config: MockConfig | None,
    n: int,
    *,
    timeout_s: float = 10.0,
    endpoint="completions",
    stream=True,
    base_url=None,
):
    runner = None
    if config is not None:
        runner, base_url = await start_mock(config)
    try:
        options = ClientOptions(
            base_url=base_url, model="mock", endpoint=endpoint, timeout_s=timeout_s, stream=stream
        )
        results = []
        plan = LoadPlan(_payloads(options, n), [0.0] * n)
        t0 = {}
        async with AiohttpTransport(options, max_connections=n) as transport:
            await run_load(
                transport,
                plan,
                results.append,
                start_callback=lambda t: t0.setdefault("t", t),
            )
        ctx = RecordContext(t0_ns=t0["t"], is_chat=options.is_chat)
        return [dataclasses.asdict(to_rows(raw, 3, ctx)[0]) for raw in results]
    finally:
        if runner is not None:
            await runner.cleanup()


@pytest.mark.parametrize(
    ("fault", "status", "error_class"),
    [
        ("error_rate", "error", "http_5xx"),
        ("reject_rate", "rejected", "rejected_429"),
        # Cut after the request went out: the server may have done the work, so `unknown`.
        ("reset_rate", "unknown", "connection_reset"),
        ("incomplete_rate", "unknown", "incomplete_stream"),
        ("malformed_sse_rate", "error", "malformed_sse"),
        ("malformed_json_rate", "error", "malformed_json"),
    ],
)
def test_fault_is_classified(fault, status, error_class):
    rows = asyncio.run(_drive(MockConfig(ttft_ms=1, itl_ms=1, **{fault: 1.0}), 4))
    assert len(rows) == 4
    assert {(r["status"], r["error_class"]) for r in rows} == {(status, error_class)}
    assert all(r["error_message"] for r in rows)


@pytest.mark.slow
def test_stall_past_the_timeout_is_a_timeout():
    rows = asyncio.run(
        _drive(MockConfig(ttft_ms=1, itl_ms=1, stall_rate=1.0, stall_s=5.0), 3, timeout_s=0.3)
    )
    assert {(r["status"], r["error_class"]) for r in rows} == {("timeout", "timeout")}
    assert all(r["t_done_ns"] - r["t_sent_ns"] < 2e9 for r in rows)


def test_bad_request_is_http_4xx():
    async def go():
        runner, base_url = await start_mock(MockConfig())
        try:
            options = ClientOptions(base_url=base_url, model="mock")
            plan = LoadPlan([RequestPayload("bad", b"{not json")], [0.0])
            results = []
            async with AiohttpTransport(options, max_connections=1) as transport:
                await run_load(transport, plan, results.append)
            record = to_rows(results[0], None, RecordContext(t0_ns=0, is_chat=False))[0]
            return dataclasses.asdict(record)
        finally:
            await runner.cleanup()

    row = asyncio.run(go())
    assert (row["status"], row["error_class"], row["http_status"]) == ("error", "http_4xx", 400)


def test_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    rows = asyncio.run(_drive(None, 2, base_url=f"http://127.0.0.1:{port}/v1"))
    assert {(r["status"], r["error_class"]) for r in rows} == {("error", "connection_refused")}


def test_mixed_faults_totals_equal_requests_scheduled():
    config = MockConfig(
        ttft_ms=1,
        itl_ms=1,
        error_rate=0.2,
        reject_rate=0.2,
        reset_rate=0.1,
        incomplete_rate=0.1,
        seed=7,
    )
    rows = asyncio.run(_drive(config, 60))
    assert len(rows) == 60
    assert len({r["request_id"] for r in rows}) == 60
    statuses = [r["status"] for r in rows]
    counted = ("ok", "error", "rejected", "unknown")
    assert sum(statuses.count(s) for s in counted) == 60
    assert 0 < statuses.count("ok") < 60


@pytest.mark.parametrize(
    ("endpoint", "stream"),
    [("completions", True), ("chat", True), ("completions", False), ("chat", False)],
)
def test_ok_requests_count_tokens_on_every_endpoint(endpoint, stream):
    rows = asyncio.run(_drive(MockConfig(ttft_ms=1, itl_ms=1), 3, endpoint=endpoint, stream=stream))
    for row in rows:
        assert row["status"] == "ok", row
        assert row["output_tokens"] == 8 and row["output_tokens_source"] == "usage"
        assert row["client_output_tokens"] == 8
        assert row["finish_reason"] == "length"
        if stream:
            assert (
                row["t_sent_ns"]
                <= row["t_first_token_ns"]
                <= row["t_last_token_ns"]
                <= row["t_done_ns"]
            )
        else:  # the response arrived whole: no token was seen before its last byte
            assert row["t_first_token_ns"] is None and row["t_last_token_ns"] is None
            assert row["t_sent_ns"] <= row["t_done_ns"]
