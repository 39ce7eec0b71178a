"""Running the engine's step loop off the HTTP event loop.

Two modes share one async face (`EngineLoop`, here, with the engine-side `EngineDriver`):
- `ThreadEngineLoop` (engine_thread.py): the engine steps in a dedicated thread. Adds and aborts are handed over
  through a deque guarded by a condition variable (the thread sleeps on it when idle); each
  step's outputs go back to the event loop in one `call_soon_threadsafe` call, which routes
  them to per-request asyncio queues.
- `ProcessEngineLoop` (engine_process.py): the engine lives in a child process (spawned, so torch starts clean);
  commands travel over a multiprocessing queue, per-step output batches back over a pipe, and
  a reader thread in the server process hands each batch to the event loop.

Both keep the engine's latest `stats()` snapshot (taken after every step and after every batch
of commands), so /metrics never touches the engine from the HTTP thread.

The server defaults to the thread mode, for the reasons and figures in `engine_thread`.
What matters for the process mode: idle OpenMP workers must sleep, not spin, on a loaded
machine (`OMP_WAIT_POLICY=PASSIVE`, set for the engine process: 227 -> 4,141 tokens/s on
tiny-random), and output batches go over a bare pipe (through a
`multiprocessing.Queue`, whose feeder thread waits for a core behind the OpenMP workers,
batches arrived 11-200 ms apart instead of a steady 10 ms).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Protocol

from engine_ref.serving.interface import (
    EngineError,
    EngineInterface,
    RequestOutput,
    SamplingParams,
    ServedStats,
    ServedTokenizer,
    kernel_level,
    pooled_embeddings,
)

ENGINE_LOOP_MODES = ("thread", "process")
STALL_WAIT_S = 0.005


class OutputSink(Protocol):
    """Where the engine loop puts a request's outputs (an `asyncio.Queue` will do)."""

    def put_nowait(self, item: RequestOutput | BaseException) -> None: ...


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
class EngineRequest:
    """One request for `engine.add_request`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None
    deadline_ms: int | None = None


@dataclass(frozen=True)
class _Admit:
    """Admit `requests` all or none: `group_id` names the group in `StepBatch.add_results`."""

    group_id: str
    requests: tuple[EngineRequest, ...]


@dataclass(frozen=True)
class SetStepDelay:
    """Fault injection: from now on, sleep `seconds` after every engine step that ran, as a
    slow accelerator would (0 turns it off). Sent only by the server's fault-injection route."""

    seconds: float


@dataclass(frozen=True)
class Pool:
    """Embed `prompts` (token ids) between steps, on the engine's thread: one unit vector
    each (`engine_ref.core.pooling`); `group_id` names the answer in `StepBatch.pooled`."""

    group_id: str
    prompts: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class EngineCall:
    """Run `fn(engine)` on the engine's thread between steps (a KV handoff's export, install
    or release: `cluster.pd_worker`); its outcome goes back before the step (`on_called`: an
    install waited 17 ms of 36 for the step it added a decode to), else in `StepBatch.called`.
    Thread mode only. `request_id`: the request `fn` adds, live from then on."""

    call_id: str
    fn: Callable[[Any], Any]
    request_id: str | None = None


@dataclass(frozen=True)
class StepBatch:
    """What the engine side reports after one iteration: the outcome of each admission group
    (None or the exception that refused it), the step's outputs, the ids failed by an engine error, and fresh stats.
    `stalled`: the engine has work but its step did nothing (nothing fits yet); the loop then
    waits briefly for new commands instead of spinning."""

    add_results: dict[str, BaseException | None]
    outputs: list[RequestOutput]
    failed_ids: tuple[str, ...]
    error: str | None
    stats: ServedStats
    stalled: bool = False
    # group id -> the vectors of a `Pool` command (lists of floats), or what failed it
    pooled: dict[str, list[list[float]] | BaseException] = field(default_factory=dict)
    called: dict[str, Any] = field(default_factory=dict)  # call id -> `EngineCall`'s outcome


class EngineDriver:
    """The engine-side half shared by both modes: apply commands, step, report."""

    def __init__(self, engine: EngineInterface) -> None:
        self.engine = engine
        self.live_ids: set[str] = set()
        self.latest_stats = engine.stats()
        self.step_delay_s = 0.0
        self.waiting_pools: list[Pool] = []  # one `Pool` runs per iteration; the rest wait
        self.on_called: Callable[[dict[str, Any], ServedStats], None] | None = None

    def has_work(self) -> bool:
        """Whether an iteration would do something without new commands: a step to take or
        a `Pool` waiting its turn."""
        return bool(self.waiting_pools) or self.engine.has_unfinished()

    def run_iteration(self, commands: list[Any]) -> StepBatch:
        add_results: dict[str, BaseException | None] = {}
        pooled: dict[str, list[list[float]] | BaseException] = {}
        called: dict[str, Any] = {}
        # One pooling batch per iteration, each answered with its own batch: 50 embedding
        # requests that queued behind one pooled forward were otherwise all run in one
        # iteration and answered together, 70 s later (bench run --endpoint embeddings).
        commands = [*self.waiting_pools, *commands]
        self.waiting_pools = []
        for command in commands:
            if isinstance(command, _Admit):
                add_results[command.group_id] = self._admit(command.requests)
            elif isinstance(command, Pool):
                if pooled:
                    self.waiting_pools.append(command)
                else:
                    pooled[command.group_id] = self._pool(command.prompts)
            elif isinstance(command, SetStepDelay):
                self.step_delay_s = command.seconds
            elif isinstance(command, EngineCall):
                try:
                    called[command.call_id] = command.fn(self.engine)
                except Exception as exc:  # answered to the caller, never a crash
                    called[command.call_id] = exc
                else:
                    if command.request_id is not None:
                        self.live_ids.add(command.request_id)
            else:  # an abort: the request id
                self.engine.abort(command)
                self.live_ids.discard(command)
        if called and self.on_called is not None:
            self.on_called(called, self.engine.stats())  # the gauges as the calls left them
            called = {}
        outputs: list[RequestOutput] = []
        failed: tuple[str, ...] = ()
        error = None
        steps_before = self.latest_stats.num_steps
        if self.engine.has_unfinished():
            try:
                outputs = self.engine.step()
            except Exception as exc:
                # The last resort: the engine fails a request it cannot run by itself
                # (finish_reason "error", RequestOutput.error), so only an exception that
                # escaped its own isolation lands here. The state of the running requests is
                # then unknown: fail them all and free their blocks, so the server keeps
                # serving new requests.
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
        if self.step_delay_s > 0 and stats.num_steps > steps_before:
            time.sleep(self.step_delay_s)
        stalled = (
            not outputs
            and error is None
            and stats.num_steps == steps_before
            and self.engine.has_unfinished()
        )
        self.latest_stats = stats
        return StepBatch(add_results, outputs, failed, error, stats, stalled, pooled, called)

    def _pool(self, prompts) -> list[list[float]] | BaseException:
        try:
            return [v.tolist() for v in pooled_embeddings(self.engine, [list(p) for p in prompts])]
        except EngineError as exc:  # reported to the one request that asked, never a crash
            return exc
        except Exception as exc:
            return EngineLoopError(f"pooling failed: {type(exc).__name__}: {exc}")

    def _admit(self, requests: tuple[EngineRequest, ...]) -> BaseException | None:
        """Add every request, or none: when one is refused, the ones added before it are
        aborted before any step runs. Returns what refused the group, or None."""
        added: list[str] = []
        try:
            for r in requests:
                self.engine.add_request(
                    r.request_id,
                    list(r.prompt_token_ids),
                    r.params,
                    priority=r.priority,
                    cache_salt=r.cache_salt,
                    tenant=r.tenant,
                    deadline_ms=r.deadline_ms,
                )
                added.append(r.request_id)
        except Exception as exc:
            for request_id in added:
                self.engine.abort(request_id)
            return exc
        self.live_ids.update(added)
        return None


class EngineLoop:
    """Async face of an engine running elsewhere. Not thread-safe: call from the event loop.

    `admit` resolves once the engine accepted (or refused) a group of requests, all or none;
    afterwards each `RequestOutput` for them lands in the given sink, and an `EngineLoopError`
    instance lands there instead if the engine fails. `abort` is fire-and-forget and idempotent.
    """

    def __init__(self) -> None:
        self.info: EngineInfo | None = None
        self.latest_stats: ServedStats | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[str, OutputSink] = {}
        self._pending_adds: dict[str, asyncio.Future] = {}  # by admission group id
        self._groups: dict[str, tuple[str, ...]] = {}  # request ids of groups not yet reported
        self._pending_pools: dict[str, asyncio.Future] = {}  # by Pool group id
        self._pending_calls: dict[str, asyncio.Future] = {}  # by EngineCall id
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

    async def admit(self, group_id: str, requests: list[EngineRequest], sink: OutputSink) -> None:
        """Hand a group of requests to the engine, admitted all or none in one engine
        iteration; raises what `engine.add_request` raised for the first one refused (e.g.
        `QueueFullError`; the others are then aborted), or `EngineLoopError` when the engine
        is gone. A caller cancelled while waiting leaves nothing running: once the engine
        reports the group admitted, every request of it is aborted."""
        if self._dead is not None:
            raise EngineLoopError(self._dead)
        assert self._loop is not None, "start() first"
        future = self._loop.create_future()
        self._pending_adds[group_id] = future
        self._groups[group_id] = tuple(r.request_id for r in requests)
        for r in requests:
            self._sinks[r.request_id] = sink
        self._submit([_Admit(group_id, tuple(requests))])
        try:
            await future
        except BaseException:
            # Refused; or cancelled while waiting, when `_on_batch` aborts the group once it
            # is admitted (its sinks are gone), unless it was admitted just before the
            # cancellation reached us: then abort it here.
            admitted = future.done() and not future.cancelled() and future.exception() is None
            for r in requests:
                if admitted:
                    self.abort(r.request_id)
                else:
                    self._sinks.pop(r.request_id, None)
            raise
        finally:
            self._pending_adds.pop(group_id, None)

    async def pool(self, group_id: str, prompts: list[list[int]]) -> list[list[float]]:
        """The pooled embedding of each prompt (`Pool`), computed between engine steps;
        raises what the engine raised for them, or `EngineLoopError` when it is gone. A caller
        cancelled while waiting leaves nothing behind (the answer is dropped)."""
        if self._dead is not None:
            raise EngineLoopError(self._dead)
        assert self._loop is not None, "start() first"
        future = self._loop.create_future()
        self._pending_pools[group_id] = future
        self._submit([Pool(group_id, tuple(tuple(p) for p in prompts))])
        try:
            return await future
        finally:
            self._pending_pools.pop(group_id, None)

    def call(
        self, fn: Callable[[Any], Any], *, request_id: str | None = None,
        sink: OutputSink | None = None,
    ) -> asyncio.Future:  # fmt: skip
        """Run `fn(engine)` on the engine's thread between steps (`EngineCall`); the future
        resolves to its result or raises what it raised (`EngineLoopError` when the engine is
        gone). It runs even when nobody awaits the future. `request_id` with `sink`: `fn` adds
        that request to the engine, whose outputs then land in `sink` (registered before
        `fn` runs, so none is missed; dropped again if `fn` raises)."""
        assert self._loop is not None, "start() first"
        future = self._loop.create_future()
        future.add_done_callback(_retrieve)
        if self._dead is not None:
            future.set_exception(EngineLoopError(self._dead))
            return future
        call_id = f"call-{id(future)}"
        self._pending_calls[call_id] = future
        if request_id is not None and sink is not None:
            self._sinks[request_id] = sink

            def drop_sink_on_failure(done: asyncio.Future) -> None:
                if done.cancelled() or done.exception() is not None:
                    self._sinks.pop(request_id, None)

            future.add_done_callback(drop_sink_on_failure)
        self._submit([EngineCall(call_id, fn, request_id)])
        return future

    def set_step_delay(self, seconds: float) -> None:
        """Fault injection: every engine step from now on takes `seconds` longer (0: off)."""
        if self._dead is None:
            self._submit([SetStepDelay(seconds)])

    def abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None and self._dead is None:
            self._submit([request_id])

    def _resolve_calls(self, called: dict[str, Any], stats: ServedStats | None = None) -> None:
        """Runs on the event loop: answer `EngineCall`s (`stats`: taken after them)."""
        if stats is not None:
            self.latest_stats = stats
        for call_id, outcome in called.items():
            future = self._pending_calls.pop(call_id, None)
            if future is not None and not future.done():
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    def _on_batch(self, batch: StepBatch) -> None:
        """Runs on the event loop, once per engine iteration."""
        self.latest_stats = batch.stats
        for group_id, vectors in batch.pooled.items():
            future = self._pending_pools.get(group_id)
            if future is not None and not future.done():
                if isinstance(vectors, BaseException):
                    future.set_exception(vectors)
                else:
                    future.set_result(vectors)
        self._resolve_calls(batch.called)
        for group_id, exc in batch.add_results.items():
            request_ids = self._groups.pop(group_id, ())
            future = self._pending_adds.get(group_id)
            if future is None or future.done():
                if exc is None:  # the caller gave up meanwhile
                    self._submit([rid for rid in request_ids if rid not in self._sinks])
                continue
            if exc is None:
                future.set_result(None)
            else:
                future.set_exception(exc)
        for output in batch.outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
            sink.put_nowait(output)
        for request_id in batch.failed_ids:
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink.put_nowait(EngineLoopError(batch.error or "engine failed"))

    def _on_dead(self, reason: str) -> None:
        self._dead = reason
        pending = [*self._pending_adds.values(), *self._pending_pools.values()]
        for future in [*pending, *self._pending_calls.values()]:
            if not future.done():
                future.set_exception(EngineLoopError(reason))
        sinks, self._sinks = list(self._sinks.values()), {}
        for sink in dict.fromkeys(sinks):  # once per sink, though it may serve several ids
            sink.put_nowait(EngineLoopError(reason))


def _retrieve(future: asyncio.Future) -> None:
    """Mark a call's exception as seen: a fire-and-forget call logs nothing."""
    if not future.cancelled():
        future.exception()


def engine_info(engine: EngineInterface) -> EngineInfo:
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
        # How an `auto` dtype was chosen (measured, cached, static rule) and why.
        "dtype_choice": (
            dataclasses.asdict(config.dtype_choice) if hasattr(config, "dtype_choice") else None
        ),
        "device": str(getattr(engine, "device", "")) or None,
        "engine_config": {k: v if isinstance(v, plain) else str(v) for k, v in fields.items()},
        "quantization": getattr(config, "quantization", None),
        # Which instruction-set level of the engine's own kernels runs ("avx512-bf16", "off: ...").
        "kernels": kernel_level(),
        "weight_bytes_by_kind": getattr(engine.stats(), "weight_bytes_by_kind", None),
        "kv_geometry": kv_geometry(engine),
    }


def kv_geometry(engine: EngineInterface) -> dict | None:
    """The KV cache's shapes, for the harness's memory bounds (M_KV = 2 L T A_kv d_h s):
    layers, KV heads, head dim, the stored element's dtype and bytes (s), what the pool spends
    per token (lossy formats' scales included), block size and count, the pool's bytes. None
    for an engine without a model runner (a test double)."""
    runner = getattr(engine, "model_runner", None)
    caches = getattr(runner, "kv_caches", None)
    if runner is None or not caches:
        return None
    mc, pool = runner.model_config, caches[0]
    per_token, block_size = int(runner.kv_bytes_per_token), int(runner.config.block_size)
    return {
        "num_layers": mc.num_hidden_layers,
        "num_kv_heads": mc.num_key_value_heads,
        "head_dim": mc.head_dim,
        "kv_cache_dtype": str(pool.dtype).removeprefix("torch."),
        "element_bytes": pool.element_size(),
        "kv_bytes_per_token": per_token,
        "block_size": block_size,
        "num_blocks": int(runner.num_blocks),
        "pool_bytes": per_token * block_size * int(runner.num_blocks),
    }
