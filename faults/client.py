"""Client faults: wrappers of the transport seam (`harness.transport.Transport`).

Each wrapper takes an inner transport and keeps its contract: a failure is recorded in the
`RawResult`, never raised, and only cancellation of the whole run propagates. A request that a
wrapper cuts on purpose ends `cancelled` with an error message containing `PLANNED_MARK` ("by the
fault plan"); one that the run stopped keeps the inner transport's message and the
`CancelledError` propagates. Warm-up requests are never faulted.

Which requests a wrapper affects: those its `active` gate admits (None: all; `RunClock.gate`
turns a plan window into one, judged when the request is sent) and, of those, a `fraction`
picked by hashing (seed, request id), so a rerun picks the same requests.

`ClientFaults` builds the whole stack a `FaultPlan` asks for, outermost first: retries, then one
cancel or disconnect wrapper per window, then the aiohttp transport (slow-reading when the plan
has a slow_reader window).
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from faults.plan import FaultKind, FaultPlan, RetryPolicy, Window, WindowTracker
from harness.client import AiohttpTransport, ClientOptions, RawResult, RequestPayload, send
from harness.transport import Transport
from slo.runrecord import ErrorClass, RequestStatus

PLANNED_MARK = "by the fault plan"
Gate = Callable[[RequestPayload], bool]


def picked(seed: int | str, request_id: str, fraction: float) -> bool:
    """Whether `request_id` falls in the `fraction` that `seed` picks (stable across runs)."""
    if fraction >= 1:
        return True
    digest = hashlib.sha256(f"{seed}\0{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def affected(
    payload: RequestPayload, active: Gate | None, seed: int | str, fraction: float
) -> bool:
    """Whether a wrapper with gate `active` (None: always open) faults this request: never a
    warm-up one, else those the gate admits and, of those, the `fraction` that `seed` picks."""
    if payload.is_warmup or (active is not None and not active(payload)):
        return False
    return picked(seed, payload.request_id, fraction)


def _unit(seed: int | str, request_id: str) -> float:
    digest = hashlib.sha256(f"cut\0{seed}\0{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class RunClock:
    """Where the measured phase is, for the client-fault gates: seconds since `start` (pass it
    as `run_load`'s `start_callback`) and how many requests were sent before each one."""

    def __init__(self, plan: FaultPlan, *, clock: Callable[[], int] = time.perf_counter_ns):
        self.plan = plan
        self.clock = clock
        self.t0_ns: int | None = None
        self.tracker = WindowTracker(plan)
        self._ordinal: dict[str, int] = {}

    def start(self, t0_ns: int) -> None:
        self.t0_ns = t0_ns

    @property
    def requests_sent(self) -> int:
        return len(self._ordinal)

    def elapsed_s(self) -> float | None:
        return None if self.t0_ns is None else (self.clock() - self.t0_ns) / 1e9

    def note_sent(self, payload: RequestPayload) -> int | None:
        """The number of measured requests sent before this one (the same on every call for
        one request id); None for warm-up requests and before `start`."""
        if payload.is_warmup or self.t0_ns is None:
            return None
        return self._ordinal.setdefault(payload.request_id, len(self._ordinal))

    def gate(self, index: int) -> Gate:
        """A gate admitting the requests sent while `plan.windows[index]` is active."""
        window = self.plan.windows[index]

        def active(payload: RequestPayload) -> bool:
            before = self.note_sent(payload)
            if before is None:
                return False
            elapsed_s = self.elapsed_s()
            self.tracker.update(elapsed_s, before)
            return window.is_active(elapsed_s, before, self.tracker.trigger_s.get(index))

        return active


class _TokenWatch(list):
    """`RawResult.reads` that calls `on_limit` once `limit` token-bearing SSE events arrived.

    A light scan, not a parse: an event bears a token when it has a non-empty `"text"` or
    `"content"` string, as `harness.sse` counts them for OpenAI-style streams. `cut_at` is
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


class CancellingTransport:
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
        self.inner, self.fraction, self.seed, self.active = inner, fraction, seed, active
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


class DisconnectStormTransport:
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
        self.inner, self.min_ms, self.max_ms = inner, min_ms, max_ms
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


class RetryAfterLog:
    """The Retry-After of each request's latest error answer, in seconds, noted by
    `FaultAiohttpTransport` and taken by `RetryingTransport`."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    def note(self, request_id: str, header: str | None) -> None:
        seconds = parse_retry_after(header)
        if seconds is not None:
            self._seconds[request_id] = seconds

    def take(self, request_id: str) -> float | None:
        return self._seconds.pop(request_id, None)


def parse_retry_after(header: str | None, *, now_s: float | None = None) -> float | None:
    """Seconds from a Retry-After value: delay-seconds ("1", "0.5") or an HTTP date (its
    distance from `now_s`, default the wall clock, never negative); None when unreadable."""
    if not header:
        return None
    try:
        return max(float(header), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(header)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - (time.time() if now_s is None else now_s), 0.0)


class _PacedContent:
    def __init__(self, content, delay_s: float, read_bytes: int) -> None:
        self._content, self._delay_s, self._read_bytes = content, delay_s, read_bytes

    async def readany(self) -> bytes:
        await asyncio.sleep(self._delay_s)
        return await self._content.read(self._read_bytes)


class _PacedResponse:
    def __init__(self, response, pacing: tuple[float, int]) -> None:
        self._response = response
        self.status = response.status
        self.headers = response.headers
        self.content = _PacedContent(response.content, *pacing)

    async def read(self) -> bytes:
        return await self._response.read()


class _Answer:
    def __init__(self, request, on_headers, pacing: tuple[float, int] | None) -> None:
        self._request, self._on_headers, self._pacing = request, on_headers, pacing

    async def __aenter__(self):
        response = await self._request.__aenter__()
        if response.status >= 400:
            self._on_headers(response.headers)
        return response if self._pacing is None else _PacedResponse(response, self._pacing)

    async def __aexit__(self, *exc_info) -> None:
        await self._request.__aexit__(*exc_info)


class _SessionView:
    """The aiohttp session as `harness.client.send` uses it (`post` as an async context manager
    giving a response with `status`, `read()` and `content.readany()`), noting the headers of
    error answers and pacing the reads when `pacing` is set."""

    def __init__(self, session, on_headers, pacing: tuple[float, int] | None) -> None:
        self._session, self._on_headers, self._pacing = session, on_headers, pacing

    def post(self, url: str, *, data: bytes) -> _Answer:
        extra = {"read_bufsize": self._pacing[1]} if self._pacing is not None else {}
        request = self._session.post(url, data=data, **extra)
        return _Answer(request, self._on_headers, self._pacing)


class FaultAiohttpTransport(AiohttpTransport):
    """`AiohttpTransport` as the fault wrappers need it: it notes each error answer's
    Retry-After in `retry_after` (the result has no headers) and lets a subclass pace the reads
    of chosen responses. Requests still go through `harness.client.send`, its one path."""

    def __init__(
        self,
        options: ClientOptions,
        *,
        max_connections: int,
        retry_after: RetryAfterLog | None = None,
    ) -> None:
        super().__init__(options, max_connections=max_connections)
        self.retry_after = retry_after

    def pacing(self, payload: RequestPayload) -> tuple[float, int] | None:
        """(seconds between reads, bytes per read) for a slowly read response; None: normal."""
        return None

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        pacing = self.pacing(payload)
        if self.retry_after is None and pacing is None:
            await send(self.session, self.options, payload, result)
            return
        log = self.retry_after

        def on_headers(headers) -> None:
            if log is not None:
                log.note(payload.request_id, headers.get("Retry-After"))

        await send(_SessionView(self.session, on_headers, pacing), self.options, payload, result)


class SlowReaderTransport(FaultAiohttpTransport):
    """Reads a `fraction` of the admitted streamed responses slowly: at most `read_bytes` per
    read, `read_delay_ms` before each, with aiohttp's read buffer cut to `read_bytes`, so the
    socket stops being drained and the server feels backpressure once the kernel's socket
    buffers fill (for token streams of ~100-byte events that can take many events). The
    recorded read times are when the client consumed the bytes, not when they arrived."""

    def __init__(
        self,
        options: ClientOptions,
        *,
        max_connections: int,
        fraction: float = 1.0,
        read_delay_ms: float,
        read_bytes: int = 256,
        seed: int | str = 0,
        active: Gate | None = None,
        retry_after: RetryAfterLog | None = None,
    ) -> None:
        super().__init__(options, max_connections=max_connections, retry_after=retry_after)
        if read_delay_ms <= 0 or read_bytes < 1:
            raise ValueError("read_delay_ms must be > 0 and read_bytes >= 1")
        self.fraction, self.seed, self.active = fraction, seed, active
        self.read_delay_ms, self.read_bytes = read_delay_ms, read_bytes

    def pacing(self, payload: RequestPayload) -> tuple[float, int] | None:
        if not affected(payload, self.active, self.seed, self.fraction):
            return None
        return self.read_delay_ms / 1e3, self.read_bytes


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One attempt of a retried request; times are `perf_counter_ns()` values (absolute).
    `status` is None when the transport left the outcome to the stream parser (a 200 answer);
    `wait_s` is the pause before the next attempt (None for the last)."""

    attempt: int
    t_sent_ns: int | None
    t_done_ns: int | None
    http_status: int | None
    status: RequestStatus | None
    error_class: ErrorClass | None
    retry_after_s: float | None = None
    wait_s: float | None = None


class RetryingTransport:
    """Resends a request whose answer's HTTP status is in `policy.statuses`, up to
    `policy.max_attempts` attempts, waiting `policy.wait_s` (Retry-After when known) between
    them; passes everything straight through when `policy.enabled` is false.

    Ledger decision: the caller's `RawResult` is the last attempt's outcome (status, reads,
    first byte, done), except `t_sent_ns`, which stays the first attempt's, so TTFT and E2E
    include the retries' waits as the user saw them; the request is recorded once.
    `attempts[request_id]` lists every attempt of each request sent more than once (an absent id
    was sent once), linking each retry to its original request.
    """

    def __init__(
        self,
        inner: Transport,
        policy: RetryPolicy,
        *,
        retry_after: RetryAfterLog | None = None,
    ) -> None:
        self.inner, self.policy, self.retry_after = inner, policy, retry_after
        self.attempts: dict[str, list[AttemptRecord]] = {}

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        if not self.policy.enabled:
            await self.inner.handle_request(payload, result)
            return
        history: list[AttemptRecord] = []
        try:
            for n in range(1, self.policy.max_attempts + 1):
                attempt = RawResult(payload.request_id, payload.is_warmup, result.t_scheduled_ns)
                try:
                    await self.inner.handle_request(payload, attempt)
                finally:
                    self._adopt(result, attempt)
                    history.append(self._record(n, attempt, payload.request_id))
                if attempt.http_status not in self.policy.statuses or n == self.policy.max_attempts:
                    return
                wait_s = self.policy.wait_s(n, history[-1].retry_after_s)
                history[-1] = replace(history[-1], wait_s=wait_s)
                try:
                    await asyncio.sleep(wait_s)
                except asyncio.CancelledError:
                    result.status, result.error_class = RequestStatus.CANCELLED, None
                    result.error_message = "the run stopped while the request waited to retry"
                    result.t_done_ns = time.perf_counter_ns()
                    raise
        finally:
            if len(history) > 1:
                self.attempts[payload.request_id] = history

    def _record(self, n: int, attempt: RawResult, request_id: str) -> AttemptRecord:
        retry_after_s = self.retry_after.take(request_id) if self.retry_after else None
        return AttemptRecord(
            n,
            attempt.t_sent_ns,
            attempt.t_done_ns,
            attempt.http_status,
            attempt.status,
            attempt.error_class,
            retry_after_s,
        )

    @staticmethod
    def _adopt(result: RawResult, attempt: RawResult) -> None:
        """Make `result` the attempt's outcome, keeping the first attempt's send time."""
        first_sent_ns = result.t_sent_ns
        for f in fields(RawResult):
            setattr(result, f.name, getattr(attempt, f.name))
        if first_sent_ns is not None:
            result.t_sent_ns = first_sent_ns


class ClientFaults:
    """The client side of a `FaultPlan` as one transport: an async context manager (it opens
    and closes the aiohttp session) whose `handle_request` runs the whole wrapper stack.

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
        self.retrying = RetryingTransport(transport, plan.retry, retry_after=self.retry_after)
        self.transport: Transport = self.retrying if plan.retry.enabled else transport

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
        return self.retrying.attempts

    async def __aenter__(self) -> ClientFaults:
        await self.base.__aenter__()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.base.__aexit__(*exc_info)

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        self.clock.note_sent(payload)
        await self.transport.handle_request(payload, result)
