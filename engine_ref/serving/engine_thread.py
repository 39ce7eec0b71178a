"""The thread mode of the engine loop: the engine steps in a daemon thread of the server
process.

The server defaults to this mode, with the engine built on its engine thread. That
matters: with the model loaded on the main thread and stepped on another, libgomp keeps two
OpenMP teams, counts more threads than cores and parks its workers after a few spins at every
barrier. `benchmarks/engine_thread_placement.py` (64 x 128 x 64 smollm2-135m, in process, no
HTTP, medians of 2 rounds) measured 446 output tokens/s on the main thread, 327 built on the
main thread and stepped on another, and 391 built and stepped on one other thread. Over HTTP
(`benchmarks/server_loop_modes.py --model smollm2-135m -n 64 --input-len 128 --output-len
128 --repeats 2`, modes alternating), the thread mode then streamed 317 output tokens/s
against the process mode's 259 (ITL p50 142 vs 194 ms), and it starts sooner and holds one
copy of torch.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from typing import Any

from engine_ref.serving.engine_loop import (
    STALL_WAIT_S,
    EngineDriver,
    EngineLoop,
    engine_info,
)
from engine_ref.serving.interface import EngineInterface

# The longest an engine thread waits, before a step, for the event loop to take the answers
# to its calls (`ThreadEngineLoop._answer_calls`).
ANSWER_WAIT_S = 0.005


class ThreadEngineLoop(EngineLoop):
    """The engine steps in a daemon thread of this process.

    Give it `build` (a callable returning the engine) rather than a built engine whenever the
    engine runs torch on the CPU: the engine is then built in the thread that steps it, so
    every torch call comes from that one thread and OpenMP keeps a single team of workers.
    (A model loaded on one thread and stepped on another leaves two teams, more OpenMP
    threads than cores, and libgomp then parks its workers after a few spins at every
    barrier; the `engine_loop` docstring says what that cost.) `start()` waits for the build and
    raises what it raised."""

    def __init__(
        self,
        engine: EngineInterface | None = None,
        *,
        build: Callable[[], EngineInterface] | None = None,
    ) -> None:
        super().__init__()
        if (engine is None) == (build is None):
            raise TypeError("pass either an engine or a build callable")
        self._build = build
        self._driver: EngineDriver | None = None
        if engine is not None:
            self._adopt(engine)
        self._commands: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._ready: asyncio.Future | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def _adopt(self, engine: EngineInterface) -> None:
        self._driver = EngineDriver(engine)
        self._driver.on_called = self._answer_calls
        self.info = engine_info(engine)
        self.latest_stats = self._driver.latest_stats

    def _answer_calls(self, called: dict, stats) -> None:
        """Runs on the engine thread: `EngineCall` outcomes to the event loop, before the step
        (with the stats after them: /metrics shows an install's blocks once it is answered).

        When a step follows, the thread first waits (at most `ANSWER_WAIT_S`) until the loop
        has run what the answers woke: on a worker pinned to one core, the step otherwise
        kept the core and the loop saw an install's answer 2-4 ms later, after the kernel
        preempted the step (`benchmarks/pd_vs_colocated.py`: a tenth of a 2,048-token KV
        transfer, the reply to the sender waiting on it)."""
        loop, caught_up = self._loop, threading.Event()

        def resolve() -> None:
            self._resolve_calls(called, stats)
            loop.call_soon(loop.call_soon, caught_up.set)  # after the tasks the answers woke

        try:
            loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the event loop closed under us
            return
        if self._driver is not None and self._driver.has_work():
            caught_up.wait(ANSWER_WAIT_S)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread.start()
        await self._ready

    def _report_ready(self, error: BaseException | None) -> None:
        """Runs on the event loop: resolve the future `start()` waits on."""
        if self._ready is None or self._ready.done():
            return
        if error is None:
            self._ready.set_result(None)
        else:
            self._ready.set_exception(error)

    async def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)

    def _submit(self, commands: list[Any]) -> None:
        with self._cond:
            self._commands.extend(commands)
            self._cond.notify()

    def _run(self) -> None:
        assert self._loop is not None
        error: BaseException | None = None
        if self._build is not None:
            try:
                self._adopt(self._build())
            except Exception as exc:
                error = exc
        try:
            self._loop.call_soon_threadsafe(self._report_ready, error)
        except RuntimeError:  # the event loop closed under us
            return
        if error is None:
            self._step_until_stopped()

    def _step_until_stopped(self) -> None:
        assert self._loop is not None and self._driver is not None
        driver = self._driver
        while True:
            with self._cond:
                while not (self._commands or self._stopping or driver.has_work()):
                    self._cond.wait()
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
            try:
                batch = self._driver.run_iteration(commands)
            except Exception as exc:  # a bug outside step(): report and stop serving
                self._loop.call_soon_threadsafe(self._on_dead, f"engine loop crashed: {exc!r}")
                return
            try:
                self._loop.call_soon_threadsafe(self._on_batch, batch)
            except RuntimeError:  # the event loop closed under us
                return
            if batch.stalled:
                with self._cond:
                    if not (self._commands or self._stopping):
                        self._cond.wait(STALL_WAIT_S)
