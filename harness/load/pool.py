"""Worker processes: the shares of one schedule (`harness.load.split`) driven by N local
processes (`--workers`).

Each worker is a spawned process with its own event loop (uvloop when installed) and connection
pool, running `run_load` on its share of the plan. `time.perf_counter_ns()` is CLOCK_MONOTONIC,
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
from dataclasses import dataclass, field

from harness.http.client import AiohttpTransport, RawResult
from harness.load.loadgen import run_load
from harness.load.services import DrivenRun, run_event_loop, run_services, stop_reason_of
from harness.load.split import WorkerShare
from slo.runrecord import ErrorClass, RequestStatus

START_LEAD_NS = 200_000_000  # the shared start time: this far after the last worker is ready
RESULT_BATCH_S = 0.02  # how often a worker sends its finished results to the parent
STOP_GRACE_S = 30.0  # a stopped worker that has not reported back by then is killed


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


async def drive_workers(
    run: DrivenRun,
    shares: list[WorkerShare],
    *,
    observer=None,
    display: contextlib.AbstractContextManager | None = None,
    on_lost: Callable[[int, str], None],
    stop_on_loss: bool,
) -> tuple[str | None, list[dict]]:
    """The load phase with its shares in worker processes; this process records their
    results through `run`. `on_lost(index, sentence)` hears of a worker that died mid-run;
    with `stop_on_loss` (`--on-worker-failure stop`) the others are stopped then.

    Returns (why the run stopped early, or None; the manifest's per-worker entries)."""
    lost: list[str] = []

    def worker_lost(index: int, sentence: str) -> None:
        lost.append(sentence)
        on_lost(index, sentence)
        if stop_on_loss:
            run.request_stop(
                f"{sentence} mid-run; the other workers were stopped (--on-worker-failure stop)"
            )

    pool = WorkerPool(shares, run.on_result, run.start, worker_lost, observer)
    signalled: dict = {}
    reason = None
    try:
        async with run_services(run) as signalled:
            pool.start()
            with display or contextlib.nullcontext():
                try:
                    await pool.wait()
                except asyncio.CancelledError:
                    pool.stop()
                    try:
                        await asyncio.wait_for(pool.wait(), STOP_GRACE_S)
                    except TimeoutError:
                        pool.kill_stragglers()
                        await pool.wait()
                    raise
    except asyncio.CancelledError:
        reason = stop_reason_of(run, signalled)
    finally:
        pool.close()
    if reason is None and lost:
        reason = (
            f"{'; '.join(lost)} mid-run: its in-flight requests are unknown, its unsent ones "
            "not_sent; the other workers ran to the end (--on-worker-failure continue)"
        )
    return reason, pool.manifest_entries()
