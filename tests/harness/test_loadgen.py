"""`run_load` driven in-process through `FakeTransport`: schedules, caps, warm-up, duration,
drain and cancellation, asserted on the recorded facts (send order, in-flight counts, the
timestamps the transport stamped), never on how long the machine took."""

from __future__ import annotations

import asyncio
import gc
from collections import Counter

import pytest
from fake_transport import FakeTransport, Stream, stream

from harness.http.client import RawResult, RequestPayload
from harness.load.loadgen import LOAD_GC_THRESHOLD, LoadPlan, LoadResult, run_load
from slo.runrecord import RequestStatus

LOOSE_LAG_NS = 1_000_000_000  # sanity bound only: far above any schedule here
HANG = Stream([], first_byte_s=30.0)  # in flight until cancelled


def _payloads(n: int, *, prefix: str = "r", is_warmup: bool = False) -> list[RequestPayload]:
    return [RequestPayload(f"{prefix}{i}", f'{{"n":{i}}}'.encode(), is_warmup) for i in range(n)]


class Run:
    """One `run_load` call: its results in the order `on_result` saw them, and its t0."""

    def __init__(self, transport: FakeTransport, plan: LoadPlan) -> None:
        self.transport = transport
        self.plan = plan
        self.results: list[RawResult] = []
        self.t0_ns: int | None = None
        self.outcome: LoadResult | None = None

    def on_start(self, t0_ns: int) -> None:
        self.t0_ns = t0_ns

    async def go(self) -> Run:
        self.outcome = await run_load(
            self.transport, self.plan, self.results.append, start_callback=self.on_start
        )
        return self

    def by_id(self) -> dict[str, RawResult]:
        return {r.request_id: r for r in self.results}

    def sent_ids(self) -> list[str]:
        return [s.request_id for s in self.transport.sent]


def _run(transport: FakeTransport, plan: LoadPlan) -> Run:
    return asyncio.run(Run(transport, plan).go())


def _assert_each_sent_reported_once(run: Run) -> None:
    sent = Counter(run.sent_ids())
    reported = Counter(r.request_id for r in run.results if r.status is not RequestStatus.NOT_SENT)
    assert reported == sent
    assert all(count == 1 for count in sent.values())


def _assert_each_planned_reported_once(run: Run) -> None:
    """A stopped run: every request of the plan has exactly one result; those never sent
    are `not_sent`, with no send time."""
    _assert_each_sent_reported_once(run)
    planned = [p.request_id for p in (*run.plan.warmup, *run.plan.payloads)]
    assert Counter(r.request_id for r in run.results) == Counter(planned)
    not_sent = {r.request_id for r in run.results if r.status is RequestStatus.NOT_SENT}
    assert not_sent == set(planned) - set(run.sent_ids())
    assert all(r.t_sent_ns is None for r in run.results if r.request_id in not_sent)
    assert run.outcome is None or run.outcome.num_not_sent == len(not_sent)


class RecordingObserver:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, bool]] = []

    def on_sent(self, raw: RawResult) -> None:
        self.events.append(("sent", raw.request_id, raw.t_sent_ns is None))

    def on_done(self, raw: RawResult) -> None:
        self.events.append(("done", raw.request_id, raw.t_done_ns is None))


def test_open_loop_sends_on_its_schedule():
    offsets_s = [0.0, 0.01, 0.02, 0.035, 0.05]
    expected_ns = [0, 10_000_000, 20_000_000, 35_000_000, 50_000_000]
    transport = FakeTransport(stream(["a", "b"], first_byte_s=0.002))
    run = _run(transport, LoadPlan(_payloads(5), offsets_s))
    assert run.sent_ids() == ["r0", "r1", "r2", "r3", "r4"]
    results = run.by_id()
    for i, want_ns in enumerate(expected_ns):
        raw = results[f"r{i}"]
        assert raw.t_scheduled_ns == run.t0_ns + want_ns
        assert 0 <= raw.t_sent_ns - raw.t_scheduled_ns < LOOSE_LAG_NS
        assert raw.t_sent_ns <= raw.t_first_byte_ns <= raw.reads[0][0] <= raw.t_done_ns
        assert raw.status is None and not raw.is_warmup
    sent_ns = [s.t_sent_ns for s in transport.sent]
    assert sent_ns == sorted(sent_ns)
    assert (run.outcome.num_scheduled, run.outcome.stopped_by_duration) == (5, False)
    assert run.outcome.t_start_ns == run.t0_ns
    _assert_each_sent_reported_once(run)


def test_observer_sees_each_request_before_sending_and_after_it_ended():
    observer = RecordingObserver()
    transport = FakeTransport(stream(["a"]))

    async def go() -> None:
        await run_load(transport, LoadPlan(_payloads(3), [0.0, 0.005, 0.01]), [].append, observer)

    asyncio.run(go())
    for rid in ("r0", "r1", "r2"):
        mine = [(kind, not_yet) for kind, r, not_yet in observer.events if r == rid]
        assert mine == [("sent", True), ("done", False)]


def test_closed_loop_users_send_one_at_a_time():
    users = 3

    def script(payload: RequestPayload) -> Stream:
        i = int(payload.request_id[1:])
        return stream(["x"] * (1 + i % 3), first_byte_s=0.002, itl_s=0.002)

    transport = FakeTransport(script)
    run = _run(transport, LoadPlan(_payloads(10), None, concurrency=users))
    assert transport.max_in_flight == users
    assert run.sent_ids() == [f"r{i}" for i in range(10)]  # taken from the queue in order
    _assert_each_sent_reported_once(run)
    results = run.by_id()
    by_user: dict[str, list[RawResult]] = {}
    for sent in transport.sent:
        by_user.setdefault(sent.sender, []).append(results[sent.request_id])
    assert len(by_user) == users
    for mine in by_user.values():
        assert mine[0].t_scheduled_ns == run.t0_ns
        for before, after in zip(mine, mine[1:], strict=False):
            assert before.t_done_ns <= after.t_scheduled_ns <= after.t_sent_ns
    assert (run.outcome.num_scheduled, run.outcome.stopped_by_duration) == (10, False)


def test_open_loop_cap_holds_requests_back_as_dispatch_lag():
    cap, n = 2, 6
    transport = FakeTransport(stream(["a"], first_byte_s=0.01, itl_s=0.005))
    run = _run(transport, LoadPlan(_payloads(n), [0.0] * n, concurrency=cap))
    assert transport.max_in_flight == cap
    assert run.sent_ids() == [f"r{i}" for i in range(n)]
    results = [run.by_id()[f"r{i}"] for i in range(n)]
    assert all(r.t_scheduled_ns == run.t0_ns for r in results)
    for k, held in enumerate(results[cap:], start=cap):
        assert held.t_sent_ns - held.t_scheduled_ns > 0
        # k requests went before it and at most cap - 1 of them may still be in flight
        finished = sum(r.t_done_ns <= held.t_sent_ns for r in results[:k])
        assert finished >= k - (cap - 1)
    _assert_each_sent_reported_once(run)


def test_each_request_records_when_the_cap_slot_it_took_was_freed():
    """The slot a held request takes was freed when an earlier request ended (after its done
    time, before the held one was sent); the cap's first requests took slots free from the
    start. The freed times are what dispatch lag starts from (`slo.summary`)."""
    cap, n = 2, 6
    transport = FakeTransport(stream(["a"], first_byte_s=0.01, itl_s=0.005))
    run = _run(transport, LoadPlan(_payloads(n), [0.0] * n, concurrency=cap))
    results = [run.by_id()[f"r{i}"] for i in range(n)]
    assert [r.slot_freed_offset_ns for r in results[:cap]] == [None] * cap
    freed = [r.t_scheduled_ns + r.slot_freed_offset_ns for r in results[cap:]]
    assert freed == sorted(freed)
    for k, (held, t_freed) in enumerate(zip(results[cap:], freed, strict=True), start=cap):
        assert t_freed <= held.t_sent_ns
        # the k - cap + 1 -th slot freed: that many earlier requests had ended by then
        assert sum(r.t_done_ns <= t_freed for r in results[:k]) >= k - cap + 1


def test_a_slot_freed_before_a_request_was_due_records_that_time():
    """Slots freed by the warm-up are free before t0: the measured requests' offsets are
    negative, so they were free to go at their scheduled time."""
    warmup = _payloads(2, prefix="w", is_warmup=True)
    transport = FakeTransport(stream(["a"]))
    plan = LoadPlan(_payloads(2), [0.0, 0.0], concurrency=2, warmup=warmup)
    run = _run(transport, plan)
    by_id = run.by_id()
    warmup_done = sorted(by_id[p.request_id].t_done_ns for p in warmup)
    freed = [by_id[rid].t_scheduled_ns + by_id[rid].slot_freed_offset_ns for rid in ("r0", "r1")]
    assert all(by_id[rid].slot_freed_offset_ns < 0 for rid in ("r0", "r1"))
    # the oldest free slot first: each warm-up's slot, freed after it ended
    assert warmup_done[0] <= freed[0] and warmup_done[1] <= freed[1] and freed[1] < run.t0_ns


@pytest.mark.parametrize("cap", [None, 2])
def test_warmup_goes_first_and_ends_before_t0(cap):
    warmup = _payloads(3, prefix="w", is_warmup=True)
    transport = FakeTransport(stream(["a"], first_byte_s=0.005, itl_s=0.005))
    plan = LoadPlan(_payloads(2), [0.0, 0.01], concurrency=cap, warmup=warmup)
    run = _run(transport, plan)
    assert run.sent_ids()[:3] == ["w0", "w1", "w2"]
    assert sorted(run.sent_ids()[3:]) == ["r0", "r1"]
    results = run.by_id()
    warm = [results[f"w{i}"] for i in range(3)]
    measured = [results["r0"], results["r1"]]
    assert all(r.is_warmup for r in warm) and not any(r.is_warmup for r in measured)
    assert len({r.t_scheduled_ns for r in warm}) == 1  # released all at once
    assert all(r.t_done_ns <= run.t0_ns for r in warm)
    assert all(run.t0_ns <= r.t_scheduled_ns <= r.t_sent_ns for r in measured)
    assert transport.max_in_flight == (cap or 3)
    assert run.outcome.num_warmup == 3 and run.outcome.num_scheduled == 2
    _assert_each_sent_reported_once(run)


@pytest.mark.parametrize(
    ("offsets_s", "duration_s", "num_sent"),
    [
        ([0.0, 0.01, 0.02, 0.2, 0.3], 0.1, 3),
        ([0.0, 0.05, 0.1], 0.1, 2),  # scheduled exactly at the deadline: not sent
    ],
)
def test_open_loop_duration_stops_dispatch(offsets_s, duration_s, num_sent):
    transport = FakeTransport(stream(["a"]))
    run = _run(transport, LoadPlan(_payloads(len(offsets_s)), offsets_s, duration_s=duration_s))
    assert run.sent_ids() == [f"r{i}" for i in range(num_sent)]
    assert run.outcome.stopped_by_duration
    assert run.outcome.num_scheduled == num_sent
    _assert_each_sent_reported_once(run)


def test_closed_loop_duration_stops_dispatch():
    duration_s = 0.2
    transport = FakeTransport(stream(["a"], first_byte_s=0.01))
    run = _run(transport, LoadPlan(_payloads(100), None, concurrency=2, duration_s=duration_s))
    assert run.outcome.stopped_by_duration
    assert 0 < run.outcome.num_scheduled == len(transport.sent) < 100
    deadline_ns = run.t0_ns + int(duration_s * 1e9)
    assert all(r.t_scheduled_ns < deadline_ns for r in run.results)
    assert all(r.status is None for r in run.results)
    _assert_each_sent_reported_once(run)


@pytest.mark.parametrize("duration_s", [None, 0.015])
def test_requests_in_flight_when_dispatch_ends_are_drained(duration_s):
    offsets_s = [0.0, 0.01, 0.02]
    transport = FakeTransport(stream(["a", "b"], first_byte_s=0.03, itl_s=0.01))
    run = _run(transport, LoadPlan(_payloads(3), offsets_s, duration_s=duration_s))
    num_sent = 3 if duration_s is None else 2
    assert len(run.results) == num_sent
    last = run.by_id()[f"r{num_sent - 1}"]
    assert last.t_done_ns - run.t0_ns > 0.02e9  # still in flight after dispatch was over
    for raw in run.results:
        assert raw.status is None and raw.http_status == 200
        assert raw.reads[-1][1] == b"data: [DONE]\n\n"
        assert raw.t_done_ns <= run.outcome.t_end_ns
    assert run.outcome.in_flight_at_stop == 0
    assert run.outcome.stopped_by_duration is (duration_s is not None)
    _assert_each_sent_reported_once(run)


def _quick_or_hang(payload: RequestPayload) -> Stream:
    return stream(["a"]) if payload.request_id in ("r0", "w0") else HANG


async def _cancel_when(run: Run, *, in_flight: int, reported: int) -> None:
    task = asyncio.create_task(run.go())
    async with asyncio.timeout(10):
        await run.transport.wait_for_in_flight(in_flight)
        while len(run.results) < reported:
            await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize(
    "plan",
    [
        LoadPlan(_payloads(5), [0.0, 0.0, 0.0, 5.0, 6.0]),
        LoadPlan(_payloads(5), [0.0, 0.0, 0.0, 0.0, 0.0], concurrency=2),
        LoadPlan(_payloads(8), None, concurrency=2),
    ],
    ids=["open", "open-capped", "closed"],
)
def test_cancelling_reports_every_request_in_flight_as_cancelled(plan):
    run = Run(FakeTransport(_quick_or_hang), plan)
    asyncio.run(_cancel_when(run, in_flight=2, reported=1))
    _assert_each_planned_reported_once(run)
    results = run.by_id()
    assert results["r0"].status is None
    cancelled = [r for r in run.results if r.status is RequestStatus.CANCELLED]
    assert len(cancelled) == 2
    assert len(run.results) == len(plan.payloads)
    for raw in cancelled:
        assert (raw.status, raw.error_class) == (RequestStatus.CANCELLED, None)
        assert raw.t_sent_ns <= raw.t_done_ns
    assert run.transport.in_flight == 0


def test_cancelling_during_warmup_reports_the_warmup_requests():
    plan = LoadPlan(_payloads(3), [0.0] * 3, warmup=_payloads(3, prefix="w", is_warmup=True))
    run = Run(FakeTransport(_quick_or_hang), plan)
    asyncio.run(_cancel_when(run, in_flight=2, reported=1))
    assert run.t0_ns is None  # the measured phase never started
    assert run.sent_ids() == ["w0", "w1", "w2"]
    _assert_each_planned_reported_once(run)
    statuses = {r.request_id: r.status for r in run.results}
    not_sent = dict.fromkeys(("r0", "r1", "r2"), RequestStatus.NOT_SENT)
    assert statuses == {
        "w0": None,
        "w1": RequestStatus.CANCELLED,
        "w2": RequestStatus.CANCELLED,
        **not_sent,
    }
    assert all(r.t_scheduled_ns is None for r in run.results if r.request_id in not_sent)


class ResultsWatchingGc(list):
    """A results list that notes the collector's first threshold as each result comes in."""

    def __init__(self) -> None:
        super().__init__()
        self.thresholds: list[int] = []

    def append(self, raw: RawResult) -> None:
        self.thresholds.append(gc.get_threshold()[0])
        super().append(raw)


@pytest.mark.parametrize("cancel", [False, True], ids=["finished", "cancelled"])
def test_the_young_generation_is_collected_less_often_while_the_load_runs(cancel):
    """The collector's first threshold is LOAD_GC_THRESHOLD while requests are answered (r0
    ends during the load either way), and the caller's again once the load ends, also when
    it is cancelled."""
    script = _quick_or_hang if cancel else stream(["a"])
    run = Run(FakeTransport(script), LoadPlan(_payloads(3), None, concurrency=2))
    run.results = ResultsWatchingGc()
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, *before[1:])
        asyncio.run(_cancel_when(run, in_flight=2, reported=1) if cancel else run.go())
        assert gc.get_threshold() == (700, *before[1:])
    finally:
        gc.set_threshold(*before)
    assert run.results.thresholds[0] == LOAD_GC_THRESHOLD
