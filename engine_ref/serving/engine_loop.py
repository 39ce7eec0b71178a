"""Running the engine's step loop off the HTTP event loop.

Two modes share one async face (`EngineLoop`):
- `ThreadEngineLoop`: the engine steps in a dedicated thread. Adds and aborts are handed over
  through a deque guarded by a condition variable (the thread sleeps on it when idle); each
  step's outputs go back to the event loop in one `call_soon_threadsafe` call, which routes
  them to per-request asyncio queues.
- `ProcessEngineLoop`: the engine lives in a child process (spawned, so torch starts clean);
  commands travel over a multiprocessing queue, per-step output batches back over a pipe, and
  a reader thread in the server process hands each batch to the event loop.

Both keep the engine's latest `stats()` snapshot (taken after every step and after every batch
of commands), so /metrics never touches the engine from the HTTP thread.

The server defaults to the thread mode, with the engine built on its engine thread. That
matters: with the model loaded on the main thread and stepped on another, libgomp keeps two
OpenMP teams, counts more threads than cores and parks its workers after a few spins at every
barrier. `benchmarks/engine_thread_placement.py` (64 x 128 x 64 smollm2-135m, in process, no
HTTP, medians of 2 rounds) measured 446 output tokens/s on the main thread, 327 built on the
main thread and stepped on another, and 391 built and stepped on one other thread. Over HTTP
(`benchmarks/server_loop_modes.py --model smollm2-135m -n 64 --input-len 128 --output-len
128 --repeats 2`, modes alternating), the thread mode then streamed 317 output tokens/s
against the process mode's 259 (ITL p50 142 vs 194 ms), and it starts sooner and holds one
copy of torch. (Before the engine was built on its own thread the two modes tied, 130 vs
133 at 32 x 128 x 64.) What matters for the process mode: idle OpenMP workers must sleep, not
spin, on a loaded machine (`OMP_WAIT_POLICY=PASSIVE`, set for the engine process: 227 ->
4,141 tokens/s on tiny-random), and output batches go over a bare pipe (through a
`multiprocessing.Queue`, whose feeder thread waits for a core behind the OpenMP workers,
batches arrived 11-200 ms apart instead of a steady 10 ms).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from engine_ref.serving.interface import (
    EngineConfig,
    EngineInterface,
    RequestOutput,
    SamplingParams,
    ServedStats,
    ServedTokenizer,
    build_engine,
)

ENGINE_LOOP_MODES = ("thread", "process")
_STALL_WAIT_S = 0.005


class EngineLoopError(RuntimeError):
    """The engine failed (a step raised, or its process died); the message says how."""


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know about the engine it fronts."""

    tokenizer: ServedTokenizer
    max_model_len: int
    model_name: str
    description: dict = field(default_factory=dict)  # engine, version, dtype, device, config


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int


@dataclass(frozen=True)
class _StepBatch:
    """What the engine side reports after one iteration: the outcome of each add (None or the
    exception), the step's outputs, the ids failed by an engine error, and fresh stats.
    `stalled`: the engine has work but its step did nothing (nothing fits yet); the loop then
    waits briefly for new commands instead of spinning."""

    add_results: dict[str, BaseException | None]
    outputs: list[RequestOutput]
    failed_ids: tuple[str, ...]
    error: str | None
    stats: ServedStats
    stalled: bool = False


class _EngineDriver:
    """The engine-side half shared by both modes: apply commands, step, report."""

    def __init__(self, engine: EngineInterface) -> None:
        self.engine = engine
        self.live_ids: set[str] = set()
        self.latest_stats = engine.stats()

    def run_iteration(self, commands: list[Any]) -> _StepBatch:
        add_results: dict[str, BaseException | None] = {}
        for command in commands:
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(
                        command.request_id,
                        list(command.prompt_token_ids),
                        command.params,
                        priority=command.priority,
                    )
                    self.live_ids.add(command.request_id)
                    add_results[command.request_id] = None
                except Exception as exc:
                    add_results[command.request_id] = exc
            else:  # an abort: the request id
                self.engine.abort(command)
                self.live_ids.discard(command)
        outputs: list[RequestOutput] = []
        failed: tuple[str, ...] = ()
        error = None
        steps_before = self.latest_stats.num_steps
        if self.engine.has_unfinished():
            try:
                outputs = self.engine.step()
            except Exception as exc:
                # The engine state of the running requests is unknown: fail them all and free
                # their blocks, so the server keeps serving new requests.
                error = f"engine step failed: {type(exc).__name__}: {exc}"
                failed = tuple(self.live_ids)
                for request_id in failed:
                    try:
                        self.engine.abort(request_id)
                    except Exception:
                        pass
                self.live_ids.clear()
        for output in outputs:
            if output.finished:
                self.live_ids.discard(output.request_id)
        stats = self.engine.stats()
        stalled = (
            not outputs
            and error is None
            and stats.num_steps == steps_before
            and self.engine.has_unfinished()
        )
        self.latest_stats = stats
        return _StepBatch(add_results, outputs, failed, error, stats, stalled)


class EngineLoop:
    """Async face of an engine running elsewhere. Not thread-safe: call from the event loop.

    `add_request` resolves once the engine accepted (or refused) the request; afterwards each
    `RequestOutput` for it lands in the given asyncio queue, and an `EngineLoopError` instance
    lands there instead if the engine fails. `abort` is fire-and-forget and idempotent.
    """

    def __init__(self) -> None:
        self.info: EngineInfo | None = None
        self.latest_stats: ServedStats | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[str, asyncio.Queue] = {}
        self._pending_adds: dict[str, asyncio.Future] = {}
        self._dead: str | None = None

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def _submit(self, commands: list[Any]) -> None:
        raise NotImplementedError

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving, or None while it is healthy."""
        return self._dead

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        params: SamplingParams,
        sink: asyncio.Queue,
        *,
        priority: int = 0,
    ) -> None:
        """Hand a request to the engine; raises what `engine.add_request` raised (e.g.
        `QueueFullError`), or `EngineLoopError` when the engine is gone."""
        if self._dead is not None:
            raise EngineLoopError(self._dead)
        assert self._loop is not None, "start() first"
        future = self._loop.create_future()
        self._pending_adds[request_id] = future
        self._sinks[request_id] = sink
        self._submit([_Add(request_id, tuple(prompt_token_ids), params, priority)])
        try:
            await future
        except BaseException:
            # Refused, or cancelled while waiting (then `_on_batch` aborts it once accepted).
            self._sinks.pop(request_id, None)
            raise
        finally:
            self._pending_adds.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None and self._dead is None:
            self._submit([request_id])

    def _on_batch(self, batch: _StepBatch) -> None:
        """Runs on the event loop, once per engine iteration."""
        self.latest_stats = batch.stats
        for request_id, exc in batch.add_results.items():
            future = self._pending_adds.get(request_id)
            if future is None or future.done():
                if exc is None and request_id not in self._sinks:
                    self._submit([request_id])  # the caller gave up meanwhile
                continue
            if exc is None:
                future.set_result(None)
            else:
                future.set_exception(exc)
        for output in batch.outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            sink.put_nowait(output)
            if output.finished:
                del self._sinks[output.request_id]
        for request_id in batch.failed_ids:
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink.put_nowait(EngineLoopError(batch.error or "engine failed"))

    def _on_dead(self, reason: str) -> None:
        self._dead = reason
        for future in self._pending_adds.values():
            if not future.done():
                future.set_exception(EngineLoopError(reason))
        for sink in self._sinks.values():
            sink.put_nowait(EngineLoopError(reason))
        self._sinks.clear()


def _engine_info(engine: EngineInterface) -> EngineInfo:
    return EngineInfo(
        tokenizer=engine.tokenizer,
        max_model_len=engine.stats().max_model_len,
        model_name=engine.config.model,
        description=describe_engine(engine),
    )


def describe_engine(engine: EngineInterface) -> dict:
    """What a benchmark manifest records about this engine (JSON-serialisable). Beyond the
    interface it records `engine.device`, the config's dtype and its dataclass fields where the
    engine has them; what an engine lacks (a test double, say) is left out rather than guessed."""
    try:
        version = metadata.version("llm-bench-harness")
    except metadata.PackageNotFoundError:
        version = None
    config = engine.config
    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {}
    plain = (str, int, float, bool, type(None))
    dtype = (
        config.torch_dtype() if hasattr(config, "torch_dtype") else getattr(config, "dtype", None)
    )
    return {
        "engine": "engine_ref",
        "version": version,
        "model": getattr(config, "model", None),
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
        "device": str(getattr(engine, "device", "")) or None,
        "engine_config": {k: v if isinstance(v, plain) else str(v) for k, v in fields.items()},
    }


class ThreadEngineLoop(EngineLoop):
    """The engine steps in a daemon thread of this process.

    Give it `build` (a callable returning the engine) rather than a built engine whenever the
    engine runs torch on the CPU: the engine is then built in the thread that steps it, so
    every torch call comes from that one thread and OpenMP keeps a single team of workers.
    (A model loaded on one thread and stepped on another leaves two teams, more OpenMP
    threads than cores, and libgomp then parks its workers after a few spins at every
    barrier; see the module docstring for what that cost.) `start()` waits for the build and
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
        self._driver: _EngineDriver | None = None
        if engine is not None:
            self._adopt(engine)
        self._commands: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._ready: asyncio.Future | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def _adopt(self, engine: EngineInterface) -> None:
        self._driver = _EngineDriver(engine)
        self.info = _engine_info(engine)
        self.latest_stats = self._driver.latest_stats

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
        engine = self._driver.engine
        while True:
            with self._cond:
                while not (self._commands or self._stopping or engine.has_unfinished()):
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
                        self._cond.wait(_STALL_WAIT_S)


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
    messages_out.send(("ready", (_engine_info(engine), engine.stats())))
    driver = _EngineDriver(engine)
    parent = multiprocessing.parent_process()
    while True:
        if not engine.has_unfinished():
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
            time.sleep(_STALL_WAIT_S)


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


def _picklable(batch: _StepBatch) -> _StepBatch:
    """Add errors cross the process boundary; replace any that would not pickle."""
    results = {}
    for request_id, exc in batch.add_results.items():
        if exc is not None:
            try:
                pickle.dumps(exc)
            except Exception:
                exc = EngineLoopError(f"{type(exc).__name__}: {exc}")
        results[request_id] = exc
    return _StepBatch(
        results, batch.outputs, batch.failed_ids, batch.error, batch.stats, batch.stalled
    )
