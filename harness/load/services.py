"""What runs around a load phase in the process that records it: SIGINT/SIGTERM handling,
periodic flushes, the `/metrics` scraper and the watch on a managed server's process
(`run_services`); the protocols the load drivers need of the run they feed; and the event loop
every load phase runs on (`run_event_loop`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Protocol

import aiohttp

from harness.http.client import RawResult
from harness.targets.scraper import MetricsScraper

SERVER_POLL_S = 0.05  # how often the managed server's process is checked during the load


def run_event_loop(coro):
    """Run `coro` on uvloop when it is installed (lower per-event overhead), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


class ServicedRun(Protocol):
    """What `run_services` needs of the run it serves (`harness.run.context.RunContext` is
    one): how often to flush, the `/metrics` scraper (an interval of 0: not sampled), whether
    a managed server is watched, the measured phase's start once known."""

    @property
    def flush_interval_s(self) -> float: ...

    @property
    def scraper(self) -> MetricsScraper: ...

    @property
    def watches_server(self) -> bool: ...

    @property
    def t0_ns(self) -> int | None: ...

    def bind_task(self, task: asyncio.Task) -> None:
        """The task a stop of the run cancels (the one driving the load)."""

    def flush(self) -> None: ...

    def server_death(self) -> str | None:
        """The sentence naming the managed server's unexpected exit, or None."""

    def request_stop(self, reason: str) -> None: ...


class DrivenRun(ServicedRun, Protocol):
    """What a load driver needs of the run it feeds besides the services: where results
    go, when the measured phase started, and why the run was stopped (None: it was not)."""

    @property
    def stop_reason(self) -> str | None: ...

    def start(self, t0_ns: int) -> None: ...

    def on_result(self, raw: RawResult) -> None: ...


async def watch_server(run: ServicedRun) -> None:
    """Stop the run (exit 3) once the managed server died: the rest would meet a closed port."""
    while True:
        await asyncio.sleep(SERVER_POLL_S)
        death = run.server_death()
        if death is not None:
            run.request_stop(death)
            return


@contextlib.asynccontextmanager
async def run_services(run: ServicedRun) -> AsyncIterator[dict]:
    """Signal handling (SIGINT/SIGTERM cancel the current task, which is bound to `run`),
    periodic flushes, the `/metrics` scraper (one last sample when the load is done) and the
    watch on a managed server's process around one run's load phase; yields `{reason}`, set
    by a signal."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    run.bind_task(main)
    stop_reason: dict = {}

    def interrupt(signame: str) -> None:
        stop_reason.setdefault("reason", f"interrupted by {signame}")
        main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, interrupt, sig.name)

    async def flusher() -> None:
        while True:
            await asyncio.sleep(run.flush_interval_s)
            run.flush()

    flush_task = asyncio.create_task(flusher())
    watch_task = asyncio.create_task(watch_server(run)) if run.watches_server else None
    scrape_task = None
    scraper = run.scraper
    try:
        async with contextlib.AsyncExitStack() as stack:
            if scraper.interval_s > 0:
                session = await stack.enter_async_context(aiohttp.ClientSession())
                scrape_task = asyncio.create_task(scraper.run(session, lambda: run.t0_ns))
            yield stop_reason
            if scrape_task is not None:
                scrape_task.cancel()
                await scraper.scrape_once(session, lambda: run.t0_ns)
    finally:
        flush_task.cancel()
        if watch_task is not None:
            watch_task.cancel()
        if scrape_task is not None:
            scrape_task.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


def stop_reason_of(run: DrivenRun, signalled: dict) -> str:
    """Why a cancelled load phase stopped: a signal, the run's own stop, or `cancelled`."""
    return signalled.get("reason") or run.stop_reason or "cancelled"
