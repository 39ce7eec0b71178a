"""Client faults against the in-process mock engine (loopback only): cancel after k tokens or
t ms, seeded fractions, disconnect storms, slow readers, retries honouring Retry-After, and
cancellation of the whole run propagating through every wrapper."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import time

import pytest
from aiohttp import web

from faults.client import (
    PLANNED_MARK,
    CancellingTransport,
    ClientFaults,
    DisconnectStormTransport,
)
from faults.gates import RunClock, picked
from faults.plan import FaultPlan
from faults.retry import RetryPolicy
from faults.retrying import RetryAfterLog, RetryingTransport, parse_retry_after
from faults.slow_reader import FaultAiohttpTransport, SlowReaderTransport
from harness.http.client import (
    AiohttpTransport,
    ClientOptions,
    RawResult,
    RequestPayload,
    build_body,
)
from harness.load.loadgen import LoadPlan, run_load
from harness.load.records import RecordContext, to_rows
from harness.targets.mock_server import MockConfig, start_mock
from slo.runrecord import Endpoint, ErrorClass, RequestStatus

RUN_STOPPED = "the run stopped while the request was in flight"


@contextlib.asynccontextmanager
async def mock(**config):
    runner, url = await start_mock(MockConfig(**config))
    try:
        yield url
    finally:
        await runner.cleanup()


def _options(url: str, *, chat: bool = False) -> ClientOptions:
    endpoint = Endpoint.CHAT if chat else Endpoint.COMPLETIONS
    return ClientOptions(base_url=url, model="mock", endpoint=endpoint, timeout_s=10)


def _payloads(options: ClientOptions, n: int, *, tokens: int = 20, prefix: str = "r"):
    spec = {"prompt": "hello there", "max_output_tokens": tokens}
    return [RequestPayload(f"{prefix}{i}", build_body(options, spec)) for i in range(n)]


async def _run(transport, payloads, *, concurrency=None, warmup=(), start_callback=None):
    """Send `payloads` all at once (or closed loop); return {request_id: (record, chunks)}."""
    results: list[RawResult] = []
    t0 = []

    def started(t0_ns: int) -> None:
        t0.append(t0_ns)
        if start_callback is not None:
            start_callback(t0_ns)

    arrivals = None if concurrency else [0.0] * len(payloads)
    plan = LoadPlan(payloads, arrivals, concurrency=concurrency, warmup=warmup)
    async with asyncio.timeout(10):
        await run_load(transport, plan, results.append, start_callback=started)
    chat = b'"messages"' in payloads[0].body
    ctx = RecordContext(t0_ns=t0[0], is_chat=chat)
    return {r.request_id: to_rows(r, 2, ctx) for r in results}


def _tokens(chunks) -> int:
    return sum(1 for _, _, n, _ in chunks if n > 0)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("itl_ms", [0.0, 5.0], ids=["coalesced", "spaced"])
def test_cancel_after_k_tokens_records_exactly_k(chat, itl_ms):
    async def go():
        async with mock(ttft_ms=5, itl_ms=itl_ms) as url:
            options = _options(url, chat=chat)
            async with AiohttpTransport(options, max_connections=8) as base:
                transport = CancellingTransport(base, after_tokens=3)
                return await _run(transport, _payloads(options, 4, tokens=40))

    rows = asyncio.run(go())
    assert len(rows) == 4
    for record, chunks in rows.values():
        assert record.status is RequestStatus.CANCELLED and record.error_class is None
        assert record.error_message == f"cancelled {PLANNED_MARK} after 3 tokens"
        assert _tokens(chunks) == 3 and record.client_output_tokens == 3


def test_cancel_after_ms_and_a_short_answer_keeps_its_outcome():
    async def go():
        async with mock(ttft_ms=5, itl_ms=10) as url:
            options = _options(url)
            async with AiohttpTransport(options, max_connections=8) as base:
                by_time = CancellingTransport(base, after_ms=60)
                timed = await _run(by_time, _payloads(options, 2, tokens=100))
                by_tokens = CancellingTransport(base, after_tokens=10)
                short = await _run(by_tokens, _payloads(options, 2, tokens=3, prefix="s"))
                return timed, short

    timed, short = asyncio.run(go())
    for record, chunks in timed.values():
        assert record.status is RequestStatus.CANCELLED
        assert record.error_message == f"cancelled {PLANNED_MARK} after 60 ms"
        # the cut's clock starts as the wrapper hands the request on: after t_scheduled, before t_sent
        assert record.t_done_ns - record.t_scheduled_ns >= 60e6
        assert record.t_done_ns - record.t_sent_ns < 1e9
        assert 0 < _tokens(chunks) < 100
    for record, chunks in short.values():
        assert record.status is RequestStatus.OK and _tokens(chunks) == 3


def test_a_seeded_fraction_picks_the_same_requests_every_run():
    async def go(seed):
        async with mock(ttft_ms=2, itl_ms=1) as url:
            options = _options(url)
            async with AiohttpTransport(options, max_connections=40) as base:
                transport = CancellingTransport(base, fraction=0.5, after_tokens=1, seed=seed)
                rows = await _run(transport, _payloads(options, 40, tokens=4))
        return {rid for rid, (rec, _) in rows.items() if rec.status is RequestStatus.CANCELLED}

    first, second, other_seed = asyncio.run(go(7)), asyncio.run(go(7)), asyncio.run(go(8))
    assert first == second and 10 <= len(first) <= 30
    assert first == {f"r{i}" for i in range(40) if picked(7, f"r{i}", 0.5)}
    assert other_seed != first


async def _streaming_server(disconnected: asyncio.Event):
    """A server streaming 200 events 5 ms apart that notes when its client went away."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(200):
                await response.write(b'data: {"choices":[{"text":" t%d"}]}\n\n' % i)
                await asyncio.sleep(0.005)
        except (ConnectionResetError, asyncio.CancelledError):
            disconnected.set()
            raise
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"


def test_a_planned_cancel_closes_the_connection():
    async def go():
        disconnected = asyncio.Event()
        runner, url = await _streaming_server(disconnected)
        try:
            options = _options(url)
            async with AiohttpTransport(options, max_connections=1) as base:
                transport = CancellingTransport(base, after_tokens=2)
                raw = RawResult("c", False, time.perf_counter_ns())
                await transport.handle_request(_payloads(options, 1)[0], raw)
                async with asyncio.timeout(2):
                    await disconnected.wait()
                return raw
        finally:
            await runner.cleanup()

    raw = asyncio.run(go())
    assert raw.status is RequestStatus.CANCELLED


def test_a_disconnect_storm_cuts_every_request_at_its_seeded_point():
    async def go():
        async with mock(ttft_ms=5, itl_ms=5) as url:
            options = _options(url)
            async with AiohttpTransport(options, max_connections=8) as base:
                storm = DisconnectStormTransport(base, min_ms=20, max_ms=200, seed=1)
                rows = await _run(storm, _payloads(options, 6, tokens=200))
                return storm, rows

    storm, rows = asyncio.run(go())
    cuts = {rid: storm.cut_ms(rid) for rid in rows}
    assert len({round(c) for c in cuts.values()}) > 1
    again = DisconnectStormTransport(None, min_ms=20, max_ms=200, seed=1)
    assert cuts == {rid: again.cut_ms(rid) for rid in rows}
    for rid, (record, _) in rows.items():
        assert 20 <= cuts[rid] < 200
        assert record.status is RequestStatus.CANCELLED
        assert record.error_message == f"disconnected {PLANNED_MARK} after {cuts[rid]:.0f} ms"
        # the cut's clock starts as the wrapper hands the request on: after t_scheduled, before t_sent
        assert record.t_done_ns - record.t_scheduled_ns >= cuts[rid] * 1e6
        assert record.t_done_ns - record.t_sent_ns < cuts[rid] * 1e6 + 5e8


def test_slow_readers_read_small_pieces_slowly_for_their_fraction():
    async def go():
        async with mock(ttft_ms=2, itl_ms=0) as url:
            options = _options(url)
            async with SlowReaderTransport(
                options, max_connections=8, fraction=0.5, read_delay_ms=20, read_bytes=128, seed=3
            ) as transport:
                payloads = _payloads(options, 8, tokens=30)
                results: list[RawResult] = []
                plan = LoadPlan(payloads, [0.0] * 8)
                async with asyncio.timeout(10):
                    await run_load(transport, plan, results.append)
                return results

    results = asyncio.run(go())
    slow = {r.request_id for r in results if picked(3, r.request_id, 0.5)}
    assert 0 < len(slow) < 8
    for raw in results:
        record, _ = to_rows(raw, 2, RecordContext(0, False))
        assert record.status is RequestStatus.OK and record.client_output_tokens == 30
        if raw.request_id in slow:
            assert all(len(data) <= 128 for _, data in raw.reads) and len(raw.reads) > 10
            gaps = [b[0] - a[0] for a, b in zip(raw.reads, raw.reads[1:], strict=False)]
            assert min(gaps) >= 19e6
        else:
            assert max(len(data) for _, data in raw.reads) > 128


def test_retries_honour_retry_after_and_record_each_request_once():
    async def go():
        async with mock(ttft_ms=2, itl_ms=1, reject_rate=0.5, seed=1) as url:
            options = _options(url)
            log = RetryAfterLog()
            policy = RetryPolicy(enabled=True, max_attempts=3)
            async with FaultAiohttpTransport(options, max_connections=8, retry_after=log) as base:
                retrying = RetryingTransport(base, policy, retry_after=log)
                rows = await _run(retrying, _payloads(options, 6, tokens=4))
                return retrying.attempts, rows

    attempts, rows = asyncio.run(go())
    assert sorted(rows) == [f"r{i}" for i in range(6)]  # one row per request
    assert attempts, "the seeded mock rejects some first attempts"
    recovered = 0
    for rid, history in attempts.items():
        record, _ = rows[rid]
        assert [a.attempt for a in history] == list(range(1, len(history) + 1))
        e2e_ns = history[-1].t_done_ns - history[0].t_sent_ns  # from the first send
        assert record.t_done_ns - record.t_sent_ns == e2e_ns
        for before, after in zip(history, history[1:], strict=False):
            assert before.http_status == 429 and before.status is RequestStatus.REJECTED
            assert before.error_class is ErrorClass.REJECTED_429
            assert before.retry_after_s == 1.0 and before.wait_s == 1.0
            assert after.t_sent_ns - before.t_done_ns >= 0.99e9
        assert history[-1].wait_s is None
        if history[-1].http_status == 200:
            recovered += 1
            assert record.status is RequestStatus.OK and record.http_status == 200
        else:
            assert record.status is RequestStatus.REJECTED and len(history) == 3
    assert recovered >= 1
    for rid, (record, _) in rows.items():
        if rid not in attempts:
            assert record.status is RequestStatus.OK


def test_retries_without_retry_after_back_off_and_keep_the_first_send_time():
    async def go():
        async with mock(ttft_ms=1, reject_rate=1.0) as url:
            options = _options(url)
            log = RetryAfterLog()
            policy = RetryPolicy(
                enabled=True, max_attempts=3, honour_retry_after=False, backoff_ms=20
            )
            async with FaultAiohttpTransport(options, max_connections=2, retry_after=log) as base:
                retrying = RetryingTransport(base, policy, retry_after=log)
                raw = RawResult("r0", False, time.perf_counter_ns())
                await retrying.handle_request(_payloads(options, 1)[0], raw)
                return retrying.attempts, raw

    attempts, raw = asyncio.run(go())
    history = attempts["r0"]
    assert [a.wait_s for a in history] == [0.02, 0.04, None]
    assert [a.http_status for a in history] == [429, 429, 429]
    assert raw.status is RequestStatus.REJECTED and raw.http_status == 429
    assert raw.t_sent_ns == history[0].t_sent_ns and raw.t_done_ns == history[-1].t_done_ns
    assert history[1].t_sent_ns - history[0].t_done_ns >= 0.02e9


def test_a_disabled_policy_sends_once():
    async def go():
        async with mock(ttft_ms=1, reject_rate=1.0) as url:
            options = _options(url)
            async with AiohttpTransport(options, max_connections=2) as base:
                retrying = RetryingTransport(base, RetryPolicy())
                rows = await _run(retrying, _payloads(options, 2))
                return retrying.attempts, rows

    attempts, rows = asyncio.run(go())
    assert attempts == {}
    assert all(rec.status is RequestStatus.REJECTED for rec, _ in rows.values())


def test_a_plan_builds_its_stack_and_gates_windows_on_requests_sent():
    plan = FaultPlan.from_dict(
        {
            "name": "t",
            "windows": [{"kind": "cancel", "after_requests": 2, "params": {"after_tokens": 1}}],
            "retry": {"enabled": True, "max_attempts": 2, "backoff_ms": 10},
        }
    )

    async def go():
        async with mock(ttft_ms=2, itl_ms=2) as url:
            options = _options(url)
            async with ClientFaults(plan, options, max_connections=2) as stack:
                warmup = [RequestPayload("w0", _payloads(options, 1)[0].body, True)]
                rows = await _run(
                    stack,
                    _payloads(options, 5, tokens=5),
                    concurrency=1,
                    warmup=warmup,
                    start_callback=stack.clock.start,
                )
                return stack, rows

    stack, rows = asyncio.run(go())
    statuses = [rows[f"r{i}"][0].status for i in range(5)]
    assert statuses == [RequestStatus.OK] * 2 + [RequestStatus.CANCELLED] * 3
    assert rows["w0"][0].status is RequestStatus.OK
    assert stack.clock.requests_sent == 5 and stack.attempts == {}


def _wrappers(base, options):
    """Every wrapper, set so that it is still waiting when the run is cancelled; those over
    `base` own it (entering one enters `base`)."""
    log = RetryAfterLog()
    return {
        "cancel_tokens": CancellingTransport(base, after_tokens=50),
        "cancel_ms": CancellingTransport(base, after_ms=60_000),
        "disconnect": DisconnectStormTransport(base, min_ms=30_000, max_ms=60_000),
        "retry": RetryingTransport(base, RetryPolicy(enabled=True), retry_after=log),
        "slow": SlowReaderTransport(options, max_connections=2, read_delay_ms=5),
        "stack": ClientFaults(FaultPlan.from_dict({"name": "t"}), options, max_connections=2),
    }


@pytest.mark.parametrize("name", list(_wrappers(None, _options("http://127.0.0.1:1/v1"))))
def test_cancelling_the_run_propagates_through_every_wrapper(name):
    async def go():
        async with mock(ttft_ms=500) as url:
            options = _options(url)
            base = AiohttpTransport(options, max_connections=4)
            async with _wrappers(base, options)[name] as transport:
                raw = RawResult("r0", False, time.perf_counter_ns())
                task = asyncio.create_task(transport.handle_request(_payloads(options, 1)[0], raw))
                await asyncio.sleep(0.1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                return task, raw

    task, raw = asyncio.run(go())
    assert task.cancelled()
    assert raw.status is RequestStatus.CANCELLED and raw.error_message == RUN_STOPPED
    assert raw.t_done_ns is not None


def test_cancelling_the_run_while_a_retry_waits_propagates():
    async def go():
        async with mock(ttft_ms=1, reject_rate=1.0) as url:
            options = _options(url)
            log = RetryAfterLog()
            async with FaultAiohttpTransport(options, max_connections=2, retry_after=log) as base:
                retrying = RetryingTransport(base, RetryPolicy(enabled=True), retry_after=log)
                plan = LoadPlan(_payloads(options, 2), [0.0, 0.0])
                results: list[RawResult] = []
                load = asyncio.create_task(run_load(retrying, plan, results.append))
                await asyncio.sleep(0.3)  # both were rejected and wait Retry-After: 1
                load.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await load
                return retrying.attempts, results

    attempts, results = asyncio.run(go())
    assert len(results) == 2
    for raw in results:
        assert raw.status is RequestStatus.CANCELLED and raw.http_status == 429
        assert raw.error_message == "the run stopped while the request waited to retry"
    assert attempts == {}  # each was sent once


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("1", 1.0), ("0.5", 0.5), ("-3", 0.0), (None, None), ("", None), ("soon", None)],
)
def test_parse_retry_after(header, seconds):
    assert parse_retry_after(header) == seconds


def test_parse_retry_after_http_date():
    now_s = 1_700_000_000.0
    header = email.utils.formatdate(now_s + 30, usegmt=True)
    assert parse_retry_after(header, now_s=now_s) == pytest.approx(30.0)
    assert parse_retry_after(email.utils.formatdate(now_s - 30, usegmt=True), now_s=now_s) == 0.0


class _Scripted:
    """An inner transport that appends scripted reads (no sockets), then ends ok."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    async def handle_request(self, payload, result) -> None:
        result.t_sent_ns = time.perf_counter_ns()
        try:
            for data in self.reads:
                await asyncio.sleep(0)
                result.reads.append((time.perf_counter_ns(), data))
        except asyncio.CancelledError:
            result.status = RequestStatus.CANCELLED
            result.error_message = RUN_STOPPED
            raise
        finally:
            result.t_done_ns = time.perf_counter_ns()


def _event(text: str | None, *, chat: bool = True, crlf: bool = False) -> bytes:
    if text is None:
        body = b'{"choices":[],"usage":{"completion_tokens":9}}'
    elif chat:
        body = b'{"choices":[{"delta":{"content":"%s"}}]}' % text.encode()
    else:
        body = b'{"choices":[{"text":"%s"}]}' % text.encode()
    return b"data: " + body + (b"\r\n\r\n" if crlf else b"\n\n")


@pytest.mark.parametrize("crlf", [False, True])
def test_token_counting_skips_role_and_usage_events_and_splits_reads(crlf):
    events = [_event("", crlf=crlf)] + [_event(f"t{i}", crlf=crlf) for i in range(4)]
    events.append(_event(None, crlf=crlf))
    blob = b"".join(events)
    # events straddle reads; the third read holds the 3rd and 4th tokens and the usage event
    reads = [blob[:7], blob[7:60], blob[60:], b"data: [DONE]\n\n"]

    async def go():
        transport = CancellingTransport(_Scripted(reads), after_tokens=3)
        raw = RawResult("x", False, time.perf_counter_ns())
        await transport.handle_request(RequestPayload("x", b"{}"), raw)
        return raw

    raw = asyncio.run(go())
    record, chunks = to_rows(raw, 1, RecordContext(0, True))
    assert record.status is RequestStatus.CANCELLED
    assert _tokens(chunks) == 3 and b"".join(d for _, d in raw.reads).endswith(events[3])


@pytest.mark.parametrize(("outer_k", "inner_k"), [(5, 2), (2, 5)])
def test_nested_cancel_windows_cut_at_the_smaller_limit(outer_k, inner_k):
    reads = [_event(f"t{i}", chat=False) for i in range(8)] + [b"data: [DONE]\n\n"]

    async def go():
        inner = CancellingTransport(_Scripted(reads), after_tokens=inner_k)
        outer = CancellingTransport(inner, after_tokens=outer_k)
        raw = RawResult("x", False, time.perf_counter_ns())
        await outer.handle_request(RequestPayload("x", b"{}"), raw)
        return raw

    raw = asyncio.run(go())
    record, chunks = to_rows(raw, 1, RecordContext(0, False))
    assert record.status is RequestStatus.CANCELLED and _tokens(chunks) == 2
    assert record.error_message == f"cancelled {PLANNED_MARK} after 2 tokens"


def test_a_timed_window_gates_the_requests_sent_inside_it():
    plan = FaultPlan.from_dict(
        {"name": "t", "windows": [{"kind": "cancel", "at": 1, "for": 1, "params": {"after_ms": 5}}]}
    )
    now = [0]
    clock = RunClock(plan, clock=lambda: now[0])
    gate = clock.gate(0)
    payload = RequestPayload("early", b"{}")
    assert not gate(payload)  # before the measured phase starts
    clock.start(0)
    seen = {}
    for i, t_s in enumerate([0.5, 0.999, 1.0, 1.5, 1.999, 2.0, 3.0]):
        now[0] = int(t_s * 1e9)
        seen[t_s] = gate(RequestPayload(f"r{i}", b"{}"))
    assert seen == {
        0.5: False,
        0.999: False,
        1.0: True,
        1.5: True,
        1.999: True,
        2.0: False,
        3.0: False,
    }
    assert not gate(RequestPayload("w", b"{}", is_warmup=True))
    assert clock.requests_sent == 7
