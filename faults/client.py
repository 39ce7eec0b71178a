"""Client faults: wrappers of the transport seam (`harness.http.transport.Transport`).

Each wrapper takes an inner transport and owns it (`faults.wrapper.TransportWrapper`: entering
the wrapper enters it, closing the wrapper closes it once). It keeps the seam's contract: a
failure is recorded in the `RawResult`, never raised, and only cancellation of the whole run
propagates. A request that a wrapper cuts on purpose ends `cancelled` with an error message
containing `PLANNED_MARK` ("by the fault plan"); one that the run stopped keeps the inner
transport's message and the `CancelledError` propagates. Warm-up requests are never faulted.

Which requests a wrapper affects: those its `active` gate admits (None: all; `RunClock.gate`
turns a plan window into one, judged when the request is sent) and, of those, a `fraction`
picked by hashing (seed, request id), so a rerun picks the same requests (`faults.gates`).

`ClientFaults` builds the whole stack a `FaultPlan` asks for, outermost first: retries
(`faults.retrying`), then one cancel or disconnect wrapper per window (here), then the aiohttp
transport (`faults.slow_reader`; slow-reading when the plan has a slow_reader window).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable

from faults.gates import Gate, RunClock, affected
from faults.plan import FaultPlan
from faults.retrying import AttemptRecord, RetryAfterLog, RetryingTransport
from faults.slow_reader import FaultAiohttpTransport, SlowReaderTransport
from faults.window import FaultKind, Window
from faults.wrapper import TransportWrapper
from harness.http.client import ClientOptions, RawResult, RequestPayload
from harness.http.transport import Transport
from slo.runrecord import RequestStatus

PLANNED_MARK = "by the fault plan"


def _unit(seed: int | str, request_id: str) -> float:
    digest = hashlib.sha256(f"cut\0{seed}\0{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class _TokenWatch(list):
    """`RawResult.reads` that calls `on_limit` once `limit` token-bearing SSE events arrived.

    A light scan, not a parse: an event bears a token when it has a non-empty `"text"` or
    `"content"` string, as `harness.http.sse` counts them for OpenAI-style streams. `cut_at` is
    (read index, byte offset) just past the `limit`-th token event. Every read is passed on to
    `parent`, the watch of an outer wrapper (nested cancel windows each keep their limit).
    """

    _EVENT_END = re.compile(rb"\r?\n\r?\n")
    _TOKEN = re.compile(rb'"(?:text|content)"\s*:\s*"(?!")')

    def __init__(self, limit: int, on_limit: Callable[[], None], parent: _TokenWatch | None):
        super().__init__()
        self.limit, self.on_limit, self.parent = limit, on_limit, parent
        self.tail = b""
        self.tokens = 0
        self.cut_at: tuple[int, int] | None = None

    def append(self, item: tuple[int, bytes]) -> None:
        super().append(item)
        if self.parent is not None:
            self.parent.append(item)
        if self.cut_at is not None:
            return
        buffer, start = self.tail + item[1], 0
        for end in self._EVENT_END.finditer(buffer):
            block, start = buffer[start : end.start()], end.end()
            if block.startswith(b"data:") and self._TOKEN.search(block):
                self.tokens += 1
                if self.tokens == self.limit:
                    self.cut_at = (len(self) - 1, start - len(self.tail))
                    self.on_limit()
                    return
        self.tail = buffer[start:]

    def kept(self) -> list[tuple[int, bytes]]:
        """The reads up to the cut (all of them when there was none)."""
        if self.cut_at is None:
            return list(self)
        index, offset = self.cut_at
        t_ns, data = self[index]
        return [*self[:index], (t_ns, data[:offset])]


async def _cut(
    inner: Transport,
    payload: RequestPayload,
    result: RawResult,
    *,
    after_tokens: int | None,
    after_ms: float | None,
    message: str,
) -> None:
    """Run `inner` as its own task and cancel it (closing its connection) after `after_tokens`
    token events or `after_ms`; once the cut fired the request is cancelled by the plan, even
    when the rest of the answer was already buffered and the inner transport finished it. The
    reads stop at the end of the k-th token event: bytes after it are dropped, as the client
    stopped consuming there. A run cancellation propagates, keeping the inner's record."""
    task = asyncio.create_task(inner.handle_request(payload, result))
    cut = False

    def fire() -> None:
        nonlocal cut
        if not task.done() and not cut:
            cut = True
            task.cancel()

    watch = None
    if after_tokens is not None:
        parent = result.reads if isinstance(result.reads, _TokenWatch) else None
        watch = result.reads = _TokenWatch(after_tokens, fire, parent)
    loop = asyncio.get_running_loop()
    timer = loop.call_later(after_ms / 1e3, fire) if after_ms is not None else None
    try:
        await task
    except asyncio.CancelledError:
        if not cut or asyncio.current_task().cancelling():
            raise  # the run was cancelled, not this request
    finally:
        if timer is not None:
            timer.cancel()
        if watch is not None and result.reads is watch:  # else a nested cut settled them
            if cut:
                result.reads = watch.kept()
            else:
                result.reads = watch.parent if watch.parent is not None else list(watch)
    if cut:
        result.status, result.error_class = RequestStatus.CANCELLED, None
        result.error_message = message


class CancellingTransport(TransportWrapper):
    """Cancels a `fraction` of the admitted requests after `after_tokens` token-bearing SSE
    events or `after_ms` ms after it starts sending (exactly one of them): status `cancelled`,
    message "cancelled by the fault plan after 3 tokens". After k tokens the recorded stream
    holds exactly k token-bearing events. A request that ends before the cut (an answer of fewer
    than k tokens, or an error) keeps its own outcome."""

    def __init__(
        self,
        inner: Transport,
        *,
        fraction: float = 1.0,
        after_tokens: int | None = None,
        after_ms: float | None = None,
        seed: int | str = 0,
        active: Gate | None = None,
    ) -> None:
        if (after_tokens is None) == (after_ms is None):
            raise ValueError("give exactly one of after_tokens and after_ms")
        super().__init__(inner)
        self.fraction, self.seed, self.active = fraction, seed, active
        self.after_tokens, self.after_ms = after_tokens, after_ms

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        if not affected(payload, self.active, self.seed, self.fraction):
            await self.inner.handle_request(payload, result)
            return
        n = self.after_tokens
        what = f"{self.after_ms:g} ms" if n is None else f"{n} token{'s' if n != 1 else ''}"
        await _cut(
            self.inner,
            payload,
            result,
            after_tokens=self.after_tokens,
            after_ms=self.after_ms,
            message=f"cancelled {PLANNED_MARK} after {what}",
        )


class DisconnectStormTransport(TransportWrapper):
    """Hangs up every admitted request (a `fraction` of them) at a point drawn uniformly from
    [min_ms, max_ms) after it starts sending, seeded by request id: status `cancelled`, message
    "disconnected by the fault plan after 412 ms"."""

    def __init__(
        self,
        inner: Transport,
        *,
        min_ms: float = 0.0,
        max_ms: float = 1000.0,
        fraction: float = 1.0,
        seed: int | str = 0,
        active: Gate | None = None,
    ) -> None:
        if not 0 <= min_ms < max_ms:
            raise ValueError("need 0 <= min_ms < max_ms")
        super().__init__(inner)
        self.min_ms, self.max_ms = min_ms, max_ms
        self.fraction, self.seed, self.active = fraction, seed, active

    def cut_ms(self, request_id: str) -> float:
        return self.min_ms + _unit(self.seed, request_id) * (self.max_ms - self.min_ms)

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        if not affected(payload, self.active, self.seed, self.fraction):
            await self.inner.handle_request(payload, result)
            return
        after_ms = self.cut_ms(payload.request_id)
        message = f"disconnected {PLANNED_MARK} after {after_ms:.0f} ms"
        await _cut(
            self.inner, payload, result, after_tokens=None, after_ms=after_ms, message=message
        )


class ClientFaults(TransportWrapper):
    """The client side of a `FaultPlan` as one transport whose `handle_request` runs the whole
    wrapper stack; it owns the stack, so entering it opens the aiohttp session at the bottom
    and closing it (`aclose`, or leaving its `with` block) closes the stack once.

    Pass `clock.start` as `run_load`'s `start_callback`; windows are judged against it, and
    `clock.requests_sent` counts every measured request (for the other layers' schedulers).
    """

    def __init__(
        self,
        plan: FaultPlan,
        options: ClientOptions,
        *,
        max_connections: int,
        clock: RunClock | None = None,
    ) -> None:
        self.plan = plan
        self.clock = clock or RunClock(plan)
        self.retry_after = RetryAfterLog() if plan.retry.enabled else None
        self.base = self._base(options, max_connections)
        transport: Transport = self.base
        for i, w in enumerate(plan.windows):
            transport = self._wrap(transport, i, w)
        self.retrying: RetryingTransport | None = None
        if plan.retry.enabled:
            transport = self.retrying = RetryingTransport(
                transport, plan.retry, retry_after=self.retry_after
            )
        super().__init__(transport)

    def _base(self, options: ClientOptions, max_connections: int) -> FaultAiohttpTransport:
        for i, w in enumerate(self.plan.windows):
            if w.kind is FaultKind.SLOW_READER:
                return SlowReaderTransport(
                    options,
                    max_connections=max_connections,
                    fraction=w.fraction,
                    read_delay_ms=w.param("read_delay_ms"),
                    read_bytes=w.param("read_bytes"),
                    seed=f"{self.plan.seed}/{i}",
                    active=self.clock.gate(i),
                    retry_after=self.retry_after,
                )
        return FaultAiohttpTransport(
            options, max_connections=max_connections, retry_after=self.retry_after
        )

    def _wrap(self, inner: Transport, i: int, w: Window) -> Transport:
        common = {
            "fraction": w.fraction,
            "seed": f"{self.plan.seed}/{i}",
            "active": self.clock.gate(i),
        }
        if w.kind is FaultKind.CANCEL:
            return CancellingTransport(
                inner, after_tokens=w.param("after_tokens"), after_ms=w.param("after_ms"), **common
            )
        if w.kind is FaultKind.DISCONNECT_STORM:
            return DisconnectStormTransport(
                inner, min_ms=w.param("min_ms"), max_ms=w.param("max_ms"), **common
            )
        return inner

    @property
    def attempts(self) -> dict[str, list[AttemptRecord]]:
        """The attempts of each request sent more than once (`RetryingTransport.attempts`)."""
        return self.retrying.attempts if self.retrying is not None else {}

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        self.clock.note_sent(payload)
        await self.inner.handle_request(payload, result)
