"""The process mode of the engine loop: the engine steps in a spawned child process; commands
go there over a queue and per-step output batches come back over a pipe (see `engine_loop`
for what each choice cost)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from engine_ref.serving.engine_loop import (
    STALL_WAIT_S,
    EngineDriver,
    EngineLoop,
    EngineLoopError,
    StepBatch,
    engine_info,
)
from engine_ref.serving.interface import EngineConfig, build_engine


class ProcessEngineLoop(EngineLoop):
    """The engine steps in a spawned child process built from an `EngineConfig`."""

    def __init__(self, config: EngineConfig, *, startup_timeout_s: float = 600.0) -> None:
        super().__init__()
        self._config = config
        self._startup_timeout_s = startup_timeout_s
        context = multiprocessing.get_context("spawn")
        # Commands go through a queue (its feeder thread keeps the event loop from blocking
        # on a full pipe); output batches come back over a bare pipe that the engine process
        # writes synchronously, so a batch never waits for a feeder thread to get a core
        # while the engine's OpenMP workers hold them.
        self._to_child = context.Queue()
        self._from_child, self._child_end = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_child_main,
            args=(config, self._to_child, self._child_end),
            name="engine-process",
            daemon=True,
        )
        self._reader: threading.Thread | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        with _child_environment():
            self._process.start()
        self._child_end.close()  # so the pipe reports EOF once the child is gone
        kind, payload = await self._loop.run_in_executor(None, self._await_ready)
        if kind != "ready":
            self._process.join(5.0)
            raise EngineLoopError(payload)
        self.info, self.latest_stats = payload
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    def _await_ready(self) -> tuple[str, Any]:
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self._from_child.poll(1.0):
                try:
                    return self._from_child.recv()
                except (EOFError, OSError):
                    break
            if not self._process.is_alive():
                break
        self._process.kill()
        return "failed", (
            f"engine process exited with code {self._process.exitcode} before it was ready"
            if self._process.exitcode is not None
            else f"engine process did not start within {self._startup_timeout_s:.0f} s"
        )

    async def close(self) -> None:
        if self._process.is_alive():
            self._to_child.put(None)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._process.join, 30.0)
        if self._process.is_alive():
            self._process.kill()
            await loop.run_in_executor(None, self._process.join, 5.0)
        if self._reader is not None:
            await loop.run_in_executor(None, self._reader.join, 5.0)
        self._to_child.close()
        self._from_child.close()

    def _submit(self, commands: list[Any]) -> None:
        self._to_child.put(commands)

    def _read(self) -> None:
        assert self._loop is not None
        while True:
            try:
                if not self._from_child.poll(1.0):
                    if self._process.is_alive():
                        continue
                    raise EOFError
                message = self._from_child.recv()
            except (EOFError, OSError):
                self._process.join(1.0)
                message = ("dead", f"engine process exited with code {self._process.exitcode}")
            kind, payload = message
            try:
                if kind == "batch":
                    self._loop.call_soon_threadsafe(self._on_batch, payload)
                    continue
                if kind == "dead":
                    self._loop.call_soon_threadsafe(self._on_dead, payload)
            except RuntimeError:  # the event loop closed under us
                pass
            return  # "stopped" or "dead"


@contextlib.contextmanager
def _child_environment() -> Iterator[None]:
    """Environment for spawning the engine process. Unless the user chose otherwise, its
    OpenMP workers sleep when idle instead of spinning (`OMP_WAIT_POLICY=PASSIVE`): spinning
    workers take the cores the HTTP process needs between steps. The variable must be set
    before the child loads torch, hence at spawn; the server process's own value is restored."""
    saved = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("OMP_WAIT_POLICY", None)


def _child_main(config: EngineConfig, commands_in: Any, messages_out: Any) -> None:
    """Entry point of the engine process: build the engine, then serve command batches.
    `messages_out` is the writing end of a pipe."""
    # Ctrl-C reaches the whole process group; the server process decides when this one stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve_engine(config, commands_in, messages_out)
    finally:
        messages_out.close()


def _serve_engine(config: EngineConfig, commands_in: Any, messages_out: Any) -> None:
    try:
        engine = build_engine(config)
    except Exception as exc:
        messages_out.send(("failed", str(exc) or repr(exc)))
        return
    messages_out.send(("ready", (engine_info(engine), engine.stats())))
    driver = EngineDriver(engine)
    parent = multiprocessing.parent_process()
    while True:
        if not driver.has_work():
            first = _wait_for_commands(commands_in, parent)
            rest = None if first is None else _drain(commands_in)
            commands = None if rest is None else first + rest
        else:
            commands = _drain(commands_in)
        if commands is None:
            messages_out.send(("stopped", None))
            return
        batch = driver.run_iteration(commands)
        messages_out.send(("batch", _picklable(batch)))
        if batch.stalled:
            time.sleep(STALL_WAIT_S)


def _wait_for_commands(commands_in: Any, parent: Any) -> list[Any] | None:
    """Block until a command batch arrives (None: stop). Wakes once a second to stop when the
    server process died without saying so."""
    while True:
        try:
            return commands_in.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None


def _drain(commands_in: Any) -> list[Any] | None:
    """Every command batch already queued, flattened; None when a stop request is among them."""
    commands: list[Any] = []
    while True:
        try:
            batch = commands_in.get_nowait()
        except queue.Empty:
            return commands
        if batch is None:
            return None
        commands.extend(batch)
    return commands


def _picklable(batch: StepBatch) -> StepBatch:
    """Add errors cross the process boundary; replace any that would not pickle."""
    results = {}
    for request_id, exc in batch.add_results.items():
        if exc is not None:
            try:
                pickle.dumps(exc)
            except Exception:
                exc = EngineLoopError(f"{type(exc).__name__}: {exc}")
        results[request_id] = exc
    return dataclasses.replace(batch, add_results=results)  # `pooled` holds picklable errors
