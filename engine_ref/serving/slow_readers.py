"""What a client that stops reading may cost: a bounded backlog and a bounded wait.

A stream's writer blocks once the socket and the transport buffer are full (aiohttp waits for
the transport to drain, with no timeout), while the engine keeps producing into the request's
sink. Two bounds end such a stream: the sink holds at most `max_backlog` outputs
(`OutputSink`), and no write may stay pending across two sweeps `timeout_s` apart
(`StallSweeper`). Either way the owner's callback runs once; the server then aborts the
request in the engine and closes the connection.

Per output the sink pays one length check; per SSE write the writer bumps two counters.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from engine_ref.serving.interface import RequestOutput


class OutputSink:
    """The engine outputs of one HTTP request, waiting for its handler. When more than
    `max_backlog` wait, `on_overflow` is scheduled on the event loop, once (not called from
    within `put_nowait`: the engine loop is then routing a batch)."""

    def __init__(self, max_backlog: int, on_overflow: Callable[[], None]) -> None:
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._max_backlog = max_backlog
        self._on_overflow: Callable[[], None] | None = on_overflow
        self._loop = asyncio.get_running_loop()

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)
        if self._on_overflow is not None and self._queue.qsize() > self._max_backlog:
            self._loop.call_soon(self._on_overflow)
            self._on_overflow = None

    async def get(self) -> RequestOutput | BaseException:
        return await self._queue.get()


class StreamWatch:
    """One stream's write counters: the writer bumps `writes_started` before each write and
    `writes_done` after it, so a write is pending while they differ."""

    __slots__ = ("writes_started", "writes_done", "on_stall", "_pending_at_sweep")

    def __init__(self, on_stall: Callable[[], None]) -> None:
        self.writes_started = 0
        self.writes_done = 0
        self.on_stall = on_stall
        self._pending_at_sweep: int | None = None  # writes_done when the last sweep saw one pending


class StallSweeper:
    """Every `timeout_s`, calls `on_stall` of each stream whose write was already pending at
    the previous sweep and still is (so it has waited between `timeout_s` and twice that)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._watches: set[StreamWatch] = set()
        self._task: asyncio.Task | None = None

    def watch(self, on_stall: Callable[[], None]) -> StreamWatch:
        watch = StreamWatch(on_stall)
        self._watches.add(watch)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sweep_forever())
        return watch

    def unwatch(self, watch: StreamWatch) -> None:
        self._watches.discard(watch)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.timeout_s)
            self.sweep()

    def sweep(self) -> None:
        for watch in list(self._watches):
            pending = watch.writes_started != watch.writes_done
            if pending and watch._pending_at_sweep == watch.writes_done:
                self._watches.discard(watch)
                watch.on_stall()
                continue
            watch._pending_at_sweep = watch.writes_done if pending else None
