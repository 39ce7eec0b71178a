"""Worker processes: one hash-pinned schedule split across N local processes (`--workers`).

Each worker is a spawned process with its own event loop (uvloop when installed) and connection
pool, running `run_load` on its share of the plan. Request i of the schedule goes to worker
i mod N (open loop: the arrival process is thinned evenly and every request keeps its own
arrival offset; closed loop: user u is on worker u mod N and request i goes to the worker of
user i mod users; sessions: whole sessions). `time.perf_counter_ns()` is CLOCK_MONOTONIC,
shared by every process of one host, so the parent picks one start time a little in the
future and every worker's times are on the parent's timeline unchanged.

The parent owns the run directory: it records every worker's results through the one
`RunContext` and recorder. A worker reports each request over its pipe before it sends it
(a synchronous write, so the report survives the worker's death) and its results in small
batches. A worker that dies: its sent-but-unrecorded requests are `unknown` (`worker_lost`),
its unsent ones `not_sent`; `--on-worker-failure` says whether the others go on or stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import orjson

from harness.errors import HarnessError
from harness.http.client import AiohttpTransport, ClientOptions, RawResult
from harness.loadgen import LoadPlan, run_load
from slo.runrecord import ErrorClass, RequestStatus

START_LEAD_NS = 200_000_000  # the shared start time: this far after the last worker is ready
RESULT_BATCH_S = 0.02  # how often a worker sends its finished results to the parent
STOP_GRACE_S = 30.0  # a stopped worker that has not reported back by then is killed
# `--workers auto`: expected output tokens/s one worker keeps up with (one process ingests
# 680-750k from the cheap mock with the compiled stream scanner: benchmarks/client_capacity.py)
TOKENS_PER_S_PER_WORKER = 600_000
USERS_PER_WORKER = 64  # `--workers auto`, closed loop
SAME_HOST_CLOCK = (
    "CLOCK_MONOTONIC (time.perf_counter_ns), shared by every process of one host: the "
    "workers' times need no alignment"
)


@dataclass(frozen=True)
class WorkerShare:
    """One worker's part of the plan (`index` of `count`), with how to reach the target."""

    index: int
    count: int
    options: ClientOptions
    plan: LoadPlan
    max_connections: int

    @property
    def request_ids(self) -> list[str]:
        """Every request this worker was given (warm-up first), in schedule order."""
        return [p.request_id for p in (*self.plan.warmup, *self.plan.payloads)]

    def scheduled_ns(self, t0_ns: int | None) -> dict[str, int | None]:
        """Each request's scheduled time once the run started at `t0_ns` (None: closed loop,
        a later turn, warm-up, or not started)."""
        arrivals = self.plan.arrival_s or [None] * len(self.plan.payloads)
        out: dict[str, int | None] = {p.request_id: None for p in self.plan.warmup}
        for payload, offset_s in zip(self.plan.payloads, arrivals, strict=True):
            out[payload.request_id] = (
                None if t0_ns is None or offset_s is None else t0_ns + round(offset_s * 1e9)
            )
        return out


def _split_evenly(total: int, n: int) -> list[int]:
    """`total` split into `n` whole parts that differ by at most one, larger parts first."""
    return [total // n + (1 if k < total % n else 0) for k in range(n)]


def split_plan(plan: LoadPlan, workers: int) -> list[LoadPlan]:
    """`plan` split into at most `workers` plans whose union is `plan` (each request once).

    Fewer plans come back when there are fewer units to split (requests, sessions, closed-loop
    users, or slots of an open-loop concurrency cap), so no worker is idle.
    """
    closed = plan.arrival_s is None
    units = len(plan.sessions.sessions) if plan.sessions is not None else len(plan.payloads)
    n = max(1, min(workers, units))
    if plan.concurrency:
        n = min(n, plan.concurrency)
    caps = _split_evenly(plan.concurrency, n) if plan.concurrency else [None] * n
    if plan.sessions is not None:
        owner_of_session = {s.session_id: k % n for k, s in enumerate(plan.sessions.sessions)}
        owner = {
            turn.request_id: owner_of_session[s.session_id]
            for s in plan.sessions.sessions
            for turn in s.turns
        }
    elif closed:
        owner = {p.request_id: (i % plan.concurrency) % n for i, p in enumerate(plan.payloads)}
    else:
        owner = {p.request_id: i % n for i, p in enumerate(plan.payloads)}
    arrivals = plan.arrival_s if plan.arrival_s is not None else [None] * len(plan.payloads)
    plans = []
    for k in range(n):
        mine = [
            (p, a) for p, a in zip(plan.payloads, arrivals, strict=True) if owner[p.request_id] == k
        ]
        sessions = None
        if plan.sessions is not None:
            sessions = replace(
                plan.sessions,
                sessions=tuple(s for j, s in enumerate(plan.sessions.sessions) if j % n == k),
            )
        plans.append(
            LoadPlan(
                payloads=[p for p, _ in mine],
                arrival_s=None if plan.arrival_s is None else [a for _, a in mine],
                concurrency=caps[k],
                duration_s=plan.duration_s,
                warmup=[w for j, w in enumerate(plan.warmup) if j % n == k],
                sessions=sessions,
            )
        )
    return plans


def auto_workers(plan: LoadPlan, cores: int | None = None) -> tuple[int, str]:
    """(`--workers auto`'s count, why): one worker per `TOKENS_PER_S_PER_WORKER` expected
    output tokens/s (open loop: the schedule's mean rate x mean max_tokens) or per
    `USERS_PER_WORKER` closed-loop users, at most cores - 1, at least 1."""
    cores = cores or os.cpu_count() or 1
    ceiling = max(1, cores - 1)
    if plan.arrival_s is None:
        users = plan.concurrency or 1
        wanted = -(-users // USERS_PER_WORKER)
        basis = f"{users} closed-loop users at {USERS_PER_WORKER} per worker"
    else:
        span_s = max(plan.arrival_s) if plan.arrival_s else 0.0
        rate = len(plan.arrival_s) / span_s if span_s > 0 else float("inf")
        lengths = [orjson.loads(p.body).get("max_tokens") or 0 for p in plan.payloads[:1000]]
        mean_len = sum(lengths) / len(lengths) if lengths else 0
        tokens_per_s = rate * mean_len
        wanted = (
            ceiling
            if tokens_per_s == float("inf")
            else max(1, -(-int(tokens_per_s) // TOKENS_PER_S_PER_WORKER))
        )
        basis = (
            f"expected {tokens_per_s:.0f} output tokens/s ({rate:.3g} requests/s x "
            f"{mean_len:.0f} tokens) at {TOKENS_PER_S_PER_WORKER} per worker"
        )
    count = max(1, min(wanted, ceiling))
    return count, f"{basis}, at most {ceiling} (cores - 1 of {cores}): {count}"


@dataclass(frozen=True)
class WorkerSplit:
    """How a run's plan was split: the shares, and what the manifest says about them."""

    shares: list[WorkerShare]
    mode: str  # "processes" or "ray"
    requested: int | str | None  # what --workers said
    why: str  # how the count was chosen
    clock: str  # how the workers' times are put on one timeline

    def worker_of(self) -> dict[str, int]:
        """request id -> the worker that was given it."""
        return {rid: s.index for s in self.shares for rid in s.request_ids}

    def manifest_entry(self) -> dict:
        return {
            "mode": self.mode,
            "count": len(self.shares),
            "requested": self.requested,
            "why": self.why,
            "assignment": ASSIGNMENT,
            "clock": self.clock,
        }


ASSIGNMENT = (
    "open loop: request i of the schedule on worker i mod N, each at its own arrival offset; "
    "closed loop: user u on worker u mod N, request i on the worker of user i mod users; "
    "sessions: whole sessions, session j on worker j mod N; warm-up request j on worker j mod N"
)


def split_for(config, plan: LoadPlan, options: ClientOptions) -> WorkerSplit:
    """The `WorkerSplit` for `config.load.workers` (a count, `auto` or None) and `config.load.ray_address`."""
    requested = config.load.workers
    if config.load.ray_address is not None:
        from harness.ray_workers import RAY_CLOCK, connect

        nodes = connect(config.load.ray_address)
        if requested in (None, "auto"):
            wanted, why = nodes, f"one Ray actor per alive node: {nodes}"
        else:
            wanted, why = int(requested), f"--workers {requested}"
        mode, clock = "ray", RAY_CLOCK
    else:
        if requested == "auto":
            wanted, why = auto_workers(plan)
        else:
            wanted, why = int(requested), f"--workers {requested}"
        mode, clock = "processes", SAME_HOST_CLOCK
    plans = split_plan(plan, wanted)
    if len(plans) < wanted:
        why += f"; {len(plans)} used (no more requests, sessions, users or slots to split)"
    shares = []
    for k, part in enumerate(plans):
        connections = part.concurrency or max(len(part.payloads), len(part.warmup), 1)
        shares.append(WorkerShare(k, len(plans), options, part, min(connections, 4096)))
    return WorkerSplit(shares, mode, requested, why, clock)


# The worker side -----------------------------------------------------------------------------


class _Reporter:
    """A `LoadObserver` that reports each request to the parent before it is sent."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def on_sent(self, raw: RawResult) -> None:
        self.conn.send(("sent", raw.request_id, raw.t_scheduled_ns, time.perf_counter_ns()))

    def on_done(self, raw: RawResult) -> None:
        pass


def worker_process_main(conn, share: WorkerShare) -> None:
    """A worker process's entry point: drive `share` and report over `conn` until done."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a run stops
    from harness.run import run_event_loop

    try:
        run_event_loop(_serve(conn, share))
    finally:
        conn.close()


async def drive_share(
    share: WorkerShare,
    *,
    start_gate,
    on_result: Callable[[RawResult], None],
    observer=None,
    transport_factory=None,
):
    """Run `share`'s plan through its own aiohttp connection pool (the body of every worker,
    a process's or a Ray actor's); returns `run_load`'s `LoadResult`."""
    factory = transport_factory or (
        lambda: AiohttpTransport(share.options, max_connections=share.max_connections)
    )
    async with factory() as transport:
        return await run_load(transport, share.plan, on_result, observer, start_gate=start_gate)


async def _serve(conn, share: WorkerShare) -> None:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    pending: list[RawResult] = []
    go: asyncio.Future = loop.create_future()

    def on_message() -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone: stop
            loop.remove_reader(conn.fileno())
            main.cancel()
            return
        if message[0] == "go" and not go.done():
            go.set_result(message[1])
        elif message[0] == "stop":
            main.cancel()

    async def start_gate() -> int:
        conn.send(("ready",))
        return await go

    async def sender() -> None:
        while True:
            await asyncio.sleep(RESULT_BATCH_S)
            send_pending()

    def send_pending() -> None:
        if pending:
            batch = pending[:]
            pending.clear()
            conn.send(("results", batch))

    loop.add_reader(conn.fileno(), on_message)
    # uvloop leaves a descriptor it watches non-blocking, and this pipe carries the results
    # too: when the parent reads more slowly than this worker streams, a send must wait for
    # room, not raise BlockingIOError half-way through a message (which killed the worker
    # and left a broken message in the pipe).
    os.set_blocking(conn.fileno(), True)
    batcher = asyncio.create_task(sender())
    stats = {}
    try:
        result = await drive_share(
            share, start_gate=start_gate, on_result=pending.append, observer=_Reporter(conn)
        )
        stats = {"dispatched": result.num_scheduled, "not_sent": result.num_not_sent}
    except asyncio.CancelledError:
        stats = {"stopped": True}
    finally:
        batcher.cancel()
        loop.remove_reader(conn.fileno())
        send_pending()
        conn.send(("finished", stats))


# The parent side -----------------------------------------------------------------------------


@dataclass
class _Worker:
    share: WorkerShare
    process: object
    conn: object
    sent: dict[str, tuple[int | None, int]] = field(default_factory=dict)  # id -> (sched, sent)
    done: set[str] = field(default_factory=set)
    ready: bool = False
    finished: bool = False
    exited: bool = False
    exit_code: int | None = None
    pid: int | None = None


@dataclass
class WorkerPool:
    """The parent's view of its worker processes: start them, give one start time, take their
    results into `on_result`, account for a dead worker's requests, stop them.

    `on_start(t0_ns)` is called once every worker is ready (warm-up done), with the shared
    start time; `on_worker_lost(index, sentence)` when a worker dies before it finished.
    """

    shares: list[WorkerShare]
    on_result: Callable[[RawResult], None]
    on_start: Callable[[int], None]
    on_worker_lost: Callable[[int, str], None]
    observer: object | None = None
    workers: list[_Worker] = field(default_factory=list)
    t0_ns: int | None = None
    stopping: bool = False
    _all_exited: asyncio.Future | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._all_exited = loop.create_future()
        context = multiprocessing.get_context("spawn")
        for share in self.shares:
            parent_conn, child_conn = context.Pipe(duplex=True)
            process = context.Process(
                target=worker_process_main,
                args=(child_conn, share),
                name=f"bench-worker-{share.index}",
                daemon=True,
            )
            process.start()
            child_conn.close()
            worker = _Worker(share, process, parent_conn, pid=process.pid)
            self.workers.append(worker)
            reader = threading.Thread(
                target=self._read, args=(loop, worker), name=f"bench-worker-{share.index}-reader"
            )
            reader.daemon = True
            reader.start()

    async def wait(self) -> None:
        """Until every worker has exited (finished, stopped or died)."""
        await asyncio.shield(self._all_exited)

    def stop(self) -> None:
        """Ask every running worker to stop: in-flight requests end `cancelled`, unsent ones
        `not_sent`, as in a Ctrl-C."""
        self.stopping = True
        for worker in self.workers:
            if not worker.exited:
                try:
                    worker.conn.send(("stop",))
                except OSError:
                    pass

    def kill_stragglers(self) -> None:
        for worker in self.workers:
            if not worker.exited:
                worker.process.kill()

    def close(self) -> None:
        """Reap every worker (one still running after a crash of this process's loop is
        stopped, then killed) and close the pipes."""
        if not all(w.exited for w in self.workers):
            self.stop()
        for worker in self.workers:
            worker.process.join(timeout=STOP_GRACE_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()

    def _read(self, loop: asyncio.AbstractEventLoop, worker: _Worker) -> None:
        """A reader thread per worker: takes its messages off the pipe as they come, so a
        worker never blocks on a full pipe while this process's loop is busy (a flush parses
        and writes), and hands them to the loop in order."""
        try:
            while True:
                message = worker.conn.recv()
                loop.call_soon_threadsafe(self._handle, worker, message)
        except RuntimeError:  # the loop closed while the worker still spoke: the run is over
            return
        except Exception:  # noqa: BLE001 - EOF, a broken pipe or a garbled message: it is gone
            # Whatever ended the pipe, the worker is over for this run: without this, a
            # message that does not unpickle would end this thread silently and the run
            # would wait for the worker's exit forever.
            with contextlib.suppress(RuntimeError):  # the loop is gone: the run is over
                loop.call_soon_threadsafe(self._on_exit, worker)

    def _handle(self, worker: _Worker, message: tuple) -> None:
        kind = message[0]
        if kind == "sent":
            _, rid, t_scheduled_ns, t_sent_ns = message
            worker.sent[rid] = (t_scheduled_ns, t_sent_ns)
            if self.observer is not None:
                self.observer.on_sent(RawResult(rid, False, t_scheduled_ns, t_sent_ns))
        elif kind == "results":
            for raw in message[1]:
                worker.done.add(raw.request_id)
                self.on_result(raw)
                if self.observer is not None:
                    self.observer.on_done(raw)
        elif kind == "ready":
            worker.ready = True
            self._maybe_go()
        elif kind == "finished":
            worker.finished = True

    def _maybe_go(self) -> None:
        if self.t0_ns is not None or self.stopping:
            return
        if all(w.ready or w.exited for w in self.workers):
            self.t0_ns = time.perf_counter_ns() + START_LEAD_NS
            self.on_start(self.t0_ns)
            for w in self.workers:
                if not w.exited:
                    w.conn.send(("go", self.t0_ns))

    def _on_exit(self, worker: _Worker) -> None:
        worker.process.join(timeout=10)
        if worker.process.is_alive():  # its pipe broke but it runs on: it is lost all the same
            worker.process.kill()
            worker.process.join()
        worker.exited = True
        worker.exit_code = worker.process.exitcode
        if not worker.finished:
            self._account_lost(worker)
        self._maybe_go()
        if all(w.exited for w in self.workers) and not self._all_exited.done():
            self._all_exited.set_result(None)

    def _account_lost(self, worker: _Worker) -> None:
        """A worker died: everything it reported sent is `unknown`, the rest `not_sent`."""
        code = worker.exit_code
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        scheduled = worker.share.scheduled_ns(self.t0_ns)
        warmup = {p.request_id for p in worker.share.plan.warmup}
        for rid in worker.share.request_ids:
            if rid in worker.done:
                continue
            if rid in worker.sent:
                t_scheduled_ns, t_sent_ns = worker.sent[rid]
                raw = RawResult(rid, rid in warmup, t_scheduled_ns, t_sent_ns)
                raw.status = RequestStatus.UNKNOWN
                raw.error_class = ErrorClass.WORKER_LOST
                raw.error_message = (
                    f"worker {worker.share.index} died ({how}) while this request was in "
                    "flight; the server may have done the work"
                )
            else:
                raw = RawResult(rid, rid in warmup, scheduled.get(rid))
                raw.status = RequestStatus.NOT_SENT
                raw.error_message = f"worker {worker.share.index} died ({how}) before sending it"
            self.on_result(raw)
        self.on_worker_lost(worker.share.index, f"worker {worker.share.index} died ({how})")

    def manifest_entries(self) -> list[dict]:
        return [
            {
                "worker": w.share.index,
                "pid": w.pid,
                "requests": len(w.share.plan.payloads),
                "warmup": len(w.share.plan.warmup),
                "exit_code": w.exit_code,
                "died": w.exited and not w.finished,
            }
            for w in self.workers
        ]


def check_workers_supported(transport) -> None:
    """Refuse, in one sentence, what `--workers`/`--ray` cannot do: a test transport lives in
    this process only (`--faults` with workers is refused by `RunConfig`)."""
    if transport is not None:
        raise HarnessError("a test transport runs in this process only; drop --workers/--ray.")
