"""Every fault wrapper owns the transport it wraps: entering the wrapper enters it once, closing
the wrapper closes it once (a second `aclose` does nothing), on every exit path and through a
nested stack; `ClientFaults` and `FaultSession` close the aiohttp session at the bottom once."""

from __future__ import annotations

import asyncio
import time

import pytest

from faults.client import CancellingTransport, ClientFaults, DisconnectStormTransport
from faults.plan import FaultPlan, load_plan
from faults.retry import RetryPolicy
from faults.retrying import RetryingTransport
from faults.session import FaultSession
from harness.http.client import ClientOptions, RawResult, RequestPayload
from harness.http.transport import BaseTransport, Transport


class RecordingTransport(BaseTransport):
    """Counts how often it is entered and closed (every `aclose` counts, so a double close
    shows) and answers each request 200 at once, noting whether it was open then."""

    def __init__(self) -> None:
        self.enters = 0
        self.closes = 0
        self.sent: list[tuple[str, bool]] = []  # (request id, open when it was sent)

    async def __aenter__(self) -> RecordingTransport:
        self.enters += 1
        return self

    async def aclose(self) -> None:
        self.closes += 1

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        self.sent.append((payload.request_id, self.enters > self.closes))
        result.t_sent_ns = time.perf_counter_ns()
        result.http_status = 200
        result.t_done_ns = time.perf_counter_ns()


# Each wrapper as a plan would set it, with cuts far enough away not to fire here.
WRAPPERS = {
    "cancel_tokens": lambda inner: CancellingTransport(inner, after_tokens=3),
    "cancel_ms": lambda inner: CancellingTransport(inner, after_ms=60_000),
    "disconnect": lambda inner: DisconnectStormTransport(inner, min_ms=30_000, max_ms=60_000),
    "retry": lambda inner: RetryingTransport(inner, RetryPolicy(enabled=True)),
    "retry_off": lambda inner: RetryingTransport(inner, RetryPolicy()),
}


def _request() -> tuple[RequestPayload, RawResult]:
    return RequestPayload("r0", b"{}"), RawResult("r0", False, time.perf_counter_ns())


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_a_wrapper_enters_and_closes_its_inner_transport_once(name):
    inner = RecordingTransport()
    wrapper = WRAPPERS[name](inner)

    async def go():
        async with wrapper as entered:
            assert entered is wrapper
            assert (inner.enters, inner.closes) == (1, 0)
            await wrapper.handle_request(*_request())
        assert (inner.enters, inner.closes) == (1, 1)
        await wrapper.aclose()
        await wrapper.aclose()

    asyncio.run(go())
    assert (inner.enters, inner.closes) == (1, 1)
    assert inner.sent == [("r0", True)]


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_a_wrapper_closes_its_inner_transport_when_the_block_raises(name):
    inner = RecordingTransport()

    async def go():
        async with WRAPPERS[name](inner):
            raise KeyError("the run failed")

    with pytest.raises(KeyError):
        asyncio.run(go())
    assert (inner.enters, inner.closes) == (1, 1)


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_aclose_without_entering_closes_the_inner_transport_once(name):
    inner = RecordingTransport()
    wrapper = WRAPPERS[name](inner)

    async def go():
        await wrapper.aclose()
        await wrapper.aclose()

    asyncio.run(go())
    assert (inner.enters, inner.closes) == (0, 1)


def test_a_wrapper_entered_again_after_closing_closes_again():
    inner = RecordingTransport()
    wrapper = CancellingTransport(inner, after_tokens=3)

    async def go():
        for _ in range(2):
            async with wrapper:
                pass
            await wrapper.aclose()

    asyncio.run(go())
    assert (inner.enters, inner.closes) == (2, 2)


def _stack(inner: Transport) -> Transport:
    """Every wrapper around `inner`, in `ClientFaults`'s order (retries outermost)."""
    cut = CancellingTransport(inner, after_tokens=3)
    timed = CancellingTransport(cut, after_ms=60_000)
    storm = DisconnectStormTransport(timed, min_ms=30_000, max_ms=60_000)
    return RetryingTransport(storm, RetryPolicy(enabled=True))


def test_a_nested_stack_of_every_wrapper_closes_the_innermost_once():
    inner = RecordingTransport()
    stack = _stack(inner)

    async def go():
        async with stack:
            assert (inner.enters, inner.closes) == (1, 0)
            await stack.handle_request(*_request())
        await stack.aclose()
        await stack.inner.aclose()  # closing a middle layer again reaches no further

    asyncio.run(go())
    assert (inner.enters, inner.closes) == (1, 1)
    assert inner.sent == [("r0", True)]


OPTIONS = ClientOptions(base_url="http://127.0.0.1:1/v1", model="m", timeout_s=5)
EVERY_CLIENT_FAULT = {
    "name": "all-client",
    "windows": [
        {"kind": "cancel", "params": {"after_tokens": 3}},
        {"kind": "disconnect_storm", "params": {"min_ms": 100, "max_ms": 200}},
        {"kind": "slow_reader", "params": {"read_delay_ms": 5}},
    ],
    "retry": {"enabled": True},
}


def _count_closes(transport: BaseTransport) -> list[int]:
    """Count the calls of `transport.aclose` (still closing it) in the list returned."""
    calls: list[int] = []
    close = transport.aclose

    async def counted() -> None:
        calls.append(1)
        await close()

    transport.aclose = counted
    return calls


@pytest.mark.parametrize("plan", [EVERY_CLIENT_FAULT, {"name": "none"}], ids=["all", "none"])
def test_client_faults_open_and_close_the_aiohttp_session_once(plan):
    faults = ClientFaults(FaultPlan.from_dict(plan), OPTIONS, max_connections=2)
    closes = _count_closes(faults.base)

    async def go():
        async with faults as entered:
            assert entered is faults
            session = faults.base.session
            assert session is not None and not session.closed
        await faults.aclose()
        return session

    session = asyncio.run(go())
    assert session.closed and faults.base.session is None
    assert len(closes) == 1


def test_a_fault_session_closes_its_client_stack_once():
    session = FaultSession(load_plan("cancel-storm"), OPTIONS, server=None, max_connections=2)

    async def go():
        async with session as entered:
            assert entered is session
            closes = _count_closes(session.client.base)
            aiohttp_session = session.client.base.session
            assert aiohttp_session is not None and not aiohttp_session.closed
        await session.aclose()
        return closes, aiohttp_session

    closes, aiohttp_session = asyncio.run(go())
    assert aiohttp_session.closed and len(closes) == 1


def test_the_aiohttp_transport_entered_twice_keeps_one_session():
    transport = ClientFaults(FaultPlan.from_dict({"name": "none"}), OPTIONS, max_connections=2)
    base = transport.base

    async def go():
        async with base:
            first = base.session
            async with base:  # a second enter while open: no second session to leak
                assert base.session is first
        return first

    first = asyncio.run(go())
    assert first.closed and base.session is None


def test_a_fault_session_that_fails_to_open_closes_what_it_opened(monkeypatch):
    """Opening the engine windows fails after the client stack opened: entering raises, and
    the stack is closed, not leaked."""
    session = FaultSession(load_plan("cancel-storm"), OPTIONS, server=None, max_connections=2)
    opened = []

    async def failing_open():
        opened.append(session.client.base.session)
        raise RuntimeError("the engine fault could not be applied")

    monkeypatch.setattr(session, "_open_engine_windows_at_zero", failing_open)

    async def go():
        async with session:
            pass

    with pytest.raises(RuntimeError, match="could not be applied"):
        asyncio.run(go())
    assert opened and opened[0].closed and session.client.base.session is None
