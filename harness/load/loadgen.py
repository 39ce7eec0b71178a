"""The load generator: schedules, sends and records. It computes nothing about latency.

Open loop: every request has a fixed arrival offset, decided before the run; an optional
concurrency cap holds requests back (the hold is client queueing, scheduled to sent; each
request records when the slot it took was freed, so dispatch lag counts only the load
generator's own lateness). Closed loop: N users, each sending its next request as soon as its
previous one is done.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from harness.http.client import RawResult, RequestPayload
from harness.http.transport import Transport
from harness.load.sessions import SessionPlan, drive_sessions
from slo.runrecord import RequestStatus

# The young generation's collection threshold while the load runs (CPython's default: 700).
# Every request leaves hundreds of short-lived containers (coroutines, reads, headers), so at
# the default the collector runs every few dozen requests, each pass a stall between a socket
# read and its timestamp; the young generation stays bounded by this count, and so does the
# memory it holds.
LOAD_GC_THRESHOLD = 10_000


class LoadObserver(Protocol):
    """Told about every send and completion (the progress display is one)."""

    def on_sent(self, raw: RawResult) -> None: ...

    def on_done(self, raw: RawResult) -> None: ...


@dataclass(frozen=True)
class LoadPlan:
    """What to send and when.

    `arrival_s[i]` is request i's offset from the start of the measured phase; `None` means
    closed loop with `concurrency` users. `concurrency` caps in-flight requests in open loop.
    `duration_s` stops dispatching new requests after that many seconds. Warm-up requests are
    sent first, all at once under the same cap, and are recorded as warm-up. With `sessions`
    (see `harness.load.sessions`) the turns are sent as their sessions say; `payloads` and
    `arrival_s` (None for turns after the first) list them for the schedule and the ledger.
    """

    payloads: Sequence[RequestPayload]
    arrival_s: Sequence[float] | None
    concurrency: int | None = None
    duration_s: float | None = None
    warmup: Sequence[RequestPayload] = ()
    sessions: SessionPlan | None = None  # multi-turn: `payloads` only name the turns

    def __post_init__(self) -> None:
        if self.arrival_s is None and not self.concurrency and self.sessions is None:
            raise ValueError("a closed-loop plan needs a concurrency (number of users)")
        if self.arrival_s is not None and len(self.arrival_s) != len(self.payloads):
            raise ValueError("arrival_s and payloads differ in length")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")

    def request_ids(self) -> Sequence[str]:
        """The ids of `payloads` in order, without building a streamed plan's bodies."""
        ids = getattr(self.payloads, "ids", None)
        return ids if ids is not None else [p.request_id for p in self.payloads]


@dataclass(slots=True)
class DispatchedResult(RawResult):
    """A `RawResult` the load generator dispatched, with `slot_freed_offset_ns`: when the
    concurrency-cap slot it took had been freed, relative to its scheduled time (negative:
    freed before it was due; None: no cap, or a slot free from the start). An offset, not a
    time, so a result moved onto another clock (`ray_workers.shift_raw` moves the times it
    knows) keeps it right; the row holds the moment (`t_slot_freed_ns`)."""

    slot_freed_offset_ns: int | None = None


class ConcurrencyCap(asyncio.Semaphore):
    """The cap on in-flight requests: a semaphore that remembers when each free slot was
    freed. `last_freed_ns` is, for the acquire that returned last, when the slot it took was
    freed (a `clock` time; None: free from the start); read it right after the acquire,
    before any await.

    Free slots are taken oldest first: the earliest a request could have gone is when the
    first slot that is free for it was freed, so any later wait (a dispatcher that came late,
    a woken waiter slow to run) is the load generator's own lateness."""

    def __init__(self, value: int, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        super().__init__(value)
        self._clock = clock
        self._freed_ns: deque[int | None] = deque([None] * value)  # one per free slot
        self.last_freed_ns: int | None = None

    async def acquire(self) -> bool:
        await super().acquire()
        self.last_freed_ns = self._freed_ns.popleft()
        return True

    def release(self) -> None:
        self._freed_ns.append(self._clock())
        super().release()


@dataclass
class LoadResult:
    """Facts about the load phase itself (the requests are with the recorder)."""

    t_start_ns: int = 0
    t_end_ns: int = 0
    num_scheduled: int = 0
    num_warmup: int = 0
    stopped_by_duration: bool = False
    in_flight_at_stop: int = 0
    num_not_sent: int = 0


async def run_load(
    transport: Transport,
    plan: LoadPlan,
    on_result: Callable[[RawResult], None],
    observer: LoadObserver | None = None,
    *,
    start_callback: Callable[[int], None] | None = None,
    start_gate: Callable[[], Awaitable[int]] | None = None,
) -> LoadResult:
    """Run warm-up, then the measured phase; call `on_result` once for every request sent.

    Every request goes out through `transport.handle_request` (the seam fault injectors wrap).

    `start_callback(t0_ns)` is called when the measured phase starts; all of that phase's
    scheduled times are `t0_ns + arrival_s * 1e9`. Cancelling this coroutine cancels every
    in-flight request, each of which is still handed to `on_result` as `cancelled`, and hands
    every request it never dispatched to `on_result` as `not_sent`, so each request of the
    plan gets exactly one result. (Requests past `duration_s` are outside the run and get
    none: a duration bounds the schedule.)

    `start_gate()`, when given, is awaited after warm-up and returns the measured phase's
    `t0_ns` (a worker process gets one start time shared by every worker); the loop waits
    until then before the first dispatch.
    """
    outcome = LoadResult()
    clock = time.perf_counter_ns
    tasks: set[asyncio.Task] = set()
    limit = ConcurrencyCap(plan.concurrency, clock) if plan.concurrency else None
    dispatched: set[str] = set()
    t0: int | None = None
    finished = False

    async def one(
        payload: RequestPayload, t_scheduled_ns: int, acquired: bool, freed_ns: int | None
    ) -> RawResult:
        dispatched.add(payload.request_id)
        raw = DispatchedResult(payload.request_id, payload.is_warmup, t_scheduled_ns)
        if freed_ns is not None:
            raw.slot_freed_offset_ns = freed_ns - t_scheduled_ns
        try:
            if observer is not None:
                observer.on_sent(raw)
            await transport.handle_request(payload, raw)
        finally:
            if acquired:
                limit.release()
            on_result(raw)
            if observer is not None:
                observer.on_done(raw)
        return raw

    def spawn(coro) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def freed(acquired: bool) -> int | None:  # called right after the acquire, no await between
        return limit.last_freed_ns if acquired else None

    def send(payload: RequestPayload, t_scheduled_ns: int, acquired: bool):
        return one(payload, t_scheduled_ns, acquired, freed(acquired))

    def launch(payload: RequestPayload, t_scheduled_ns: int, acquired: bool) -> None:
        spawn(send(payload, t_scheduled_ns, acquired))

    gc_threshold = gc.get_threshold()
    gc.set_threshold(max(gc_threshold[0], LOAD_GC_THRESHOLD), *gc_threshold[1:])
    try:
        if plan.warmup:
            now = clock()
            for payload in plan.warmup:
                if limit is not None:
                    await limit.acquire()
                launch(payload, now, limit is not None)
            outcome.num_warmup = len(plan.warmup)
            await asyncio.gather(*list(tasks))

        if start_gate is None:
            t0 = clock()
        else:
            t0 = await start_gate()
            await asyncio.sleep(max(0, t0 - clock()) / 1e9)
        outcome.t_start_ns = t0
        if start_callback is not None:
            start_callback(t0)
        deadline_ns = t0 + int(plan.duration_s * 1e9) if plan.duration_s else None
        if plan.sessions is not None:
            outcome.num_scheduled, outcome.stopped_by_duration = await drive_sessions(
                plan.sessions,
                t0=t0,
                deadline_ns=deadline_ns,
                limit=limit,
                users=plan.concurrency if plan.arrival_s is None else None,
                send=send,
                spawn=spawn,
                dispatched=dispatched,
                on_result=on_result,
            )
        elif plan.arrival_s is not None:
            outcome.num_scheduled, outcome.stopped_by_duration = await _open_loop(
                plan, t0, deadline_ns, limit, launch
            )
        else:
            outcome.num_scheduled, outcome.stopped_by_duration = await _closed_loop(
                plan, t0, deadline_ns, transport, on_result, observer, dispatched
            )
        while tasks:  # session tasks may spawn more (closed-loop users)
            await asyncio.gather(*list(tasks))
        finished = True
    finally:
        gc.set_threshold(*gc_threshold)
        outcome.in_flight_at_stop = len(tasks)
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.gather(*list(tasks), return_exceptions=True)
        if not finished:
            outcome.num_not_sent = _report_not_sent(plan, dispatched, t0, on_result)
        outcome.t_end_ns = clock()
    return outcome


def _report_not_sent(plan: LoadPlan, dispatched: set[str], t0: int | None, on_result) -> int:
    """Hand every request of `plan` that was never dispatched to `on_result` as `not_sent`."""
    count = 0
    arrivals = plan.arrival_s if plan.arrival_s is not None else [None] * len(plan.payloads)
    pending = itertools.chain(
        ((p.request_id, True, None) for p in plan.warmup),
        zip(plan.request_ids(), itertools.repeat(False), arrivals, strict=False),
    )
    for request_id, is_warmup, offset_s in pending:
        if request_id in dispatched:
            continue
        scheduled = None if (t0 is None or offset_s is None) else t0 + round(offset_s * 1e9)
        raw = RawResult(request_id, is_warmup, scheduled)
        raw.status = RequestStatus.NOT_SENT
        raw.error_message = "the run stopped before this request was sent"
        on_result(raw)
        count += 1
    return count


async def _open_loop(plan, t0, deadline_ns, limit, launch) -> tuple[int, bool]:
    clock = time.perf_counter_ns
    sent = 0
    for payload, offset_s in zip(plan.payloads, plan.arrival_s, strict=True):
        t_scheduled = t0 + round(offset_s * 1e9)
        if deadline_ns is not None and t_scheduled >= deadline_ns:
            return sent, True
        delay_ns = t_scheduled - clock()
        if delay_ns > 0:
            await asyncio.sleep(delay_ns / 1e9)
        if limit is not None:
            await limit.acquire()
        launch(payload, t_scheduled, limit is not None)
        sent += 1
    return sent, False


async def _closed_loop(
    plan, t0, deadline_ns, transport, on_result, observer, dispatched
) -> tuple[int, bool]:
    clock = time.perf_counter_ns
    queue = iter(plan.payloads)
    counters = {"sent": 0, "stopped": False}

    async def user() -> None:
        t_ready = t0
        while True:
            if deadline_ns is not None and clock() >= deadline_ns:
                counters["stopped"] = True
                return
            payload = next(queue, None)
            if payload is None:
                return
            counters["sent"] += 1
            dispatched.add(payload.request_id)
            raw = RawResult(payload.request_id, payload.is_warmup, t_ready)
            try:
                if observer is not None:
                    observer.on_sent(raw)
                await transport.handle_request(payload, raw)
            finally:
                on_result(raw)
                if observer is not None:
                    observer.on_done(raw)
            t_ready = clock()

    await asyncio.gather(*(user() for _ in range(plan.concurrency)))
    return counters["sent"], counters["stopped"]
