"""A P/D worker: a reference server whose engine prefills and hands its KV off (role "prefill")
or takes handed-off KV and decodes (role "decode"); the router pairs them (`cluster.pd`).

A request names its part with `kv_transfer_params`, vLLM's field for disaggregated prefill,
in its body (any other body is served as the single server serves it):
- `{"do_remote_decode": true, "transfer_id": T, "decode_kv": "host:port"}`, on a prefill
  worker: the prompt runs through `HandoffExporter`; its first token streams to the caller as
  soon as it is sampled (finish_reason "handoff"); the KV is then exported, sent over the KV
  link (`kv_tcp.send_handoff`, each block checksummed) to the decode worker's `KVReceiver`,
  and released, whether the transfer succeeded or not. The answer's usage carries
  `kv_transfer`: transfer_id, ok, error (one sentence or null), error_kind, bytes (on the
  wire), transfer_ms, prefill_ms (arrival to first token), worker, first_token_ids. A request
  that ends at its first token holds nothing and sends nothing (no `kv_transfer`).
- `{"do_remote_prefill": true, "transfer_id": T}`, on a decode worker: the request attaches to
  the request installed under T and streams the tokens after the first. Blocks for it are
  reserved when the handoff's header arrives and each block is written into its slot as it
  passes its checksum (`pd_landing`); the install happens when the whole handoff has arrived
  and passed, on the engine thread between steps (`EngineLoop.call`), with the
  sampling parameters the prefill worker parsed (they travel in the link's header, `extra`),
  so the request decodes from the next step on and its outputs wait in a `_ParkedSink` until
  the caller attaches; the answer's usage carries `kv_transfer: {install_ms, worker}` (the
  install's time, waiting for free blocks included, and this worker). A handoff finding too
  few free blocks waits for them (up to `install_wait_s`), then is refused with
  `NoFreeBlocks`, which the sender is told. An installed request nobody attaches to within
  `park_timeout_s` is aborted (its blocks freed); a caller whose handoff does not arrive
  within that time gets 404.
- `{"recompute_token_ids": [ids]}`: the retry after a failed transfer: prefill the prompt
  plus these already-emitted tokens here and continue (greedy output then equals the single
  engine's). The answer's usage counts the ids as prompt: the router corrects it.

With `enable_fault_injection`, `{"fault": "flip_bit"}` beside `do_remote_decode` flips one bit
of the first block on the wire (after its checksum was computed): the receiver must refuse it.
P/D workers run the engine in thread mode (`EngineLoop.call` runs a closure on its thread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from engine_ref.cluster import pd_landing
from engine_ref.cluster.kv_link import KVLinkError, KVTransferRejected, StagingBuffers
from engine_ref.cluster.kv_tcp import KVReceiver, send_handoff
from engine_ref.serving.engine_loop import EngineLoop, EngineLoopError
from engine_ref.serving.engine_thread import ThreadEngineLoop
from engine_ref.serving.errors import ApiError
from engine_ref.serving.generation import GenerationRun
from engine_ref.serving.interface import (
    EngineError,
    HandoffExporter,
    KVHandoff,
    KVHandoffError,
    NoFreeBlocks,
    SamplingParams,
    build_engine,
    install_handoff,
)
from engine_ref.serving.requests import decode_json_body
from engine_ref.serving.server import ServerConfig, ServerError, serve

__all__ = ["ROLES", "HandoffEngine", "PDWorker", "params_from_json", "params_to_json"]

ROLES = ("prefill", "decode")
HANDOFF_PREFIX = "kvh-"  # engine request ids run through the exporter / installed from a handoff
FIELD = "kv_transfer_params"


class HandoffEngine:
    """A prefill worker's engine: stepped through `HandoffExporter`; requests whose id starts
    with `HANDOFF_PREFIX` are added through it, the others as usual."""

    def __init__(self, engine: Any) -> None:
        self.inner = engine
        self.exporter = HandoffExporter(engine)

    def __getattr__(self, name: str) -> Any:  # tokenizer, config, model, model_runner, ...
        return getattr(self.inner, name)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, **kwargs) -> None:
        if request_id.startswith(HANDOFF_PREFIX):
            self.exporter.add_request(request_id, prompt_token_ids, params, **kwargs)
        else:
            self.inner.add_request(request_id, prompt_token_ids, params, **kwargs)

    def step(self) -> list:
        return self.exporter.step()

    def abort(self, request_id: str) -> None:
        self.exporter.release(request_id)  # held blocks, or a request still prefilling
        self.inner.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def stats(self) -> Any:
        return self.inner.stats()


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    """`params` as JSON (a handoff never carries guided decoding, so every field is plain)."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def params_from_json(data: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def transfer_params(raw_body: bytes) -> dict[str, Any] | None:
    """The body's `kv_transfer_params` (None when absent); ApiError 400 unless an object."""
    if FIELD.encode() not in raw_body:
        return None
    value = decode_json_body(raw_body).get(FIELD)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, f"{FIELD} must be an object.", param=FIELD)
    return value


def _text(params: dict[str, Any], name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{FIELD}.{name} must be a non-empty string.", param=FIELD)
    return value


def _single(run: GenerationRun) -> None:
    if len(run.gen.prompts) != 1 or run.gen.params.n != 1:
        raise ApiError(400, "A P/D request carries one prompt and one choice (n 1).", param=FIELD)


class PrefillRun(GenerationRun):
    """A `do_remote_decode` request on a prefill worker (module doc)."""

    def __init__(self, endpoint, gen, *, worker: PDWorker, params: dict, **kwargs) -> None:
        super().__init__(endpoint, gen, **kwargs)
        self.engine_ids = [HANDOFF_PREFIX + rid for rid in self.engine_ids]
        self.prompt_index = {rid: i for i, rid in enumerate(self.engine_ids)}
        self.worker, self.params = worker, params
        self.kv_transfer: dict[str, Any] | None = None
        self.t_arrival_s = time.perf_counter()

    async def submit(self) -> None:
        _single(self)
        self.transfer_id = _text(self.params, "transfer_id")
        host, _, port = _text(self.params, "decode_kv").rpartition(":")
        if not host or not port.isdigit():
            raise ApiError(400, f"{FIELD}.decode_kv must be host:port.", param=FIELD)
        self.decode_kv = (host, int(port))
        await super().submit()

    async def next_changes(self) -> list[int]:
        changed = await super().next_changes()
        if not self.unfinished and self.kv_transfer is None:
            if self.choices[0].finish_reason == "handoff":
                await self._hand_off()
        return changed

    async def _hand_off(self) -> None:
        engine_id = self.engine_ids[0]
        t_start_s = time.perf_counter()
        record: dict[str, Any] = {
            "transfer_id": self.transfer_id, "ok": False, "error": None, "error_kind": None,
            "bytes": 0, "transfer_ms": 0.0,
            "prefill_ms": round((t_start_s - self.t_arrival_s) * 1e3, 3),
            "worker": self.worker.name, "first_token_ids": [],
        }  # fmt: skip
        staging, taken = self.worker.staging, []

        def take(nbytes: int):  # a buffer a previous handoff used (`core.staging`)
            taken.append(staging.take(nbytes))
            return taken[-1]

        try:
            handoff: KVHandoff = await self.engine_loop.call(
                lambda engine: engine.exporter.export(engine_id, allocate=take)
            )
            record["first_token_ids"] = list(handoff.token_ids[handoff.num_prompt_tokens :])
            extra = {
                "transfer_id": self.transfer_id,
                "params": params_to_json(self.gen.params),
                "priority": self.gen.priority,
                "cache_salt": self.gen.cache_salt,
                "tenant": self.gen.tenant,
            }
            counted = _Counted(self._fault())
            try:
                await send_handoff(*self.decode_kv, handoff, extra=extra, transform=counted)
            finally:
                record["bytes"] = counted.num_bytes
            record["ok"] = True
        except (KVLinkError, KVHandoffError, OSError, TimeoutError, EngineLoopError) as exc:
            kind = exc.kind if isinstance(exc, KVTransferRejected) else type(exc).__name__
            record["error"], record["error_kind"] = str(exc) or kind, kind
        finally:
            self.engine_loop.call(lambda engine: engine.exporter.release(engine_id))
            handoff = None  # its blocks are views of the buffer given back here
            for buffer in taken:
                staging.give(buffer)
        record["transfer_ms"] = round((time.perf_counter() - t_start_s) * 1e3, 3)
        self.kv_transfer = record

    def _fault(self):
        if self.params.get("fault") == "flip_bit" and self.worker.config.enable_fault_injection:
            return _flip_first_block_bit
        return None

    def usage(self) -> dict[str, Any]:
        usage = super().usage()
        if self.kv_transfer is not None:
            usage["kv_transfer"] = self.kv_transfer
        return usage


class _Counted:
    """A `send_handoff` transform counting the bytes sent, after an optional inner transform."""

    def __init__(self, inner) -> None:
        self.inner, self.num_bytes = inner, 0

    def __call__(self, frames: Iterator) -> Iterable:
        for frame in frames if self.inner is None else self.inner(frames):
            self.num_bytes += len(memoryview(frame).cast("B"))
            yield frame


def _flip_first_block_bit(frames: Iterator) -> Iterator:
    """Fault injection: the frames with bit 0 of the first block's first payload byte flipped
    (frames: header, then per block its record and payload parts)."""
    for index, frame in enumerate(frames):
        if index == 2:
            frame = bytearray(memoryview(frame).cast("B"))
            frame[0] ^= 1
        yield frame


class _ParkedSink:
    """An installed request's outputs, kept until a caller attaches, then passed on."""

    def __init__(self) -> None:
        self.buffer: list = []
        self.target = None

    def put_nowait(self, item) -> None:
        (self.buffer.append if self.target is None else self.target.put_nowait)(item)

    def forward_to(self, target) -> None:
        for item in self.buffer:
            target.put_nowait(item)
        self.buffer.clear()
        self.target = target


@dataclass
class _Parked:
    engine_id: str
    params: SamplingParams
    sink: _ParkedSink
    expiry: asyncio.TimerHandle
    install_ms: float  # the callback's arrival to the request installed (waits included)


class DecodeRun(GenerationRun):
    """A `do_remote_prefill` request on a decode worker: attaches to the installed request."""

    def __init__(self, endpoint, gen, *, worker: PDWorker, params: dict, **kwargs) -> None:
        super().__init__(endpoint, gen, **kwargs)
        self.worker, self.params = worker, params
        self.install_ms: float | None = None

    async def submit(self) -> None:
        _single(self)
        transfer_id = _text(self.params, "transfer_id")
        parked = await self.worker.attach(transfer_id)
        self.install_ms = parked.install_ms
        self.engine_ids = [parked.engine_id]
        self.prompt_index = {parked.engine_id: 0}
        if parked.params != self.gen.params:
            self.engine_loop.abort(parked.engine_id)
            raise ApiError(
                400, f"The request's sampling parameters differ from transfer {transfer_id}'s."
            )
        self.timers = {parked.engine_id: self.metrics.tracker()}
        self.unfinished.add(parked.engine_id)
        parked.sink.forward_to(self.sink)

    def usage(self) -> dict[str, Any]:
        usage = super().usage()
        if self.install_ms is not None:  # the router merges it into its `kv_transfer`
            usage["kv_transfer"] = {"install_ms": self.install_ms, "worker": self.worker.name}
        return usage


class PDWorker:
    """A worker's P/D side: its role, the run factory its server uses, and (decode) the
    requests installed from handoffs, by transfer id."""

    def __init__(
        self, role: str, name: str, engine_loop: EngineLoop, config: ServerConfig, *,
        park_timeout_s: float = 30.0, install_wait_s: float = 10.0,
    ) -> None:  # fmt: skip
        if role not in ROLES:
            raise ServerError(f"Unknown worker role {role!r}; known: {', '.join(ROLES)}.")
        self.role, self.name, self.engine_loop, self.config = role, name, engine_loop, config
        self.park_timeout_s, self.install_wait_s = park_timeout_s, install_wait_s
        self.parked: dict[str, _Parked] = {}
        self._arrivals: dict[str, asyncio.Event] = {}
        # Buffers of past handoffs: exported into (prefill), received into (decode).
        self.staging = StagingBuffers()
        self._landings: dict[str, pd_landing.EngineLanding] = {}  # by transfer id

    async def on_header(self, header: dict, extra: dict | None) -> pd_landing.EngineLanding | None:
        """`KVReceiver`'s `on_header`: blocks reserved for the handoff on its way."""
        transfer_id = extra.get("transfer_id") if isinstance(extra, dict) else None
        if not isinstance(transfer_id, str):
            return None  # refused by `on_handoff` once it has arrived
        landing = await pd_landing.reserve(self.engine_loop, header)
        if landing is not None:
            self._landings[transfer_id] = landing
        return landing

    def make_run(self, endpoint, gen, raw_body: bytes, **kwargs) -> GenerationRun:
        """The server's `run_factory` (`serving.server.create_app`)."""
        try:
            params = transfer_params(raw_body)
        except ApiError as error:
            return _Refused(endpoint, gen, error=error, **kwargs)
        if params is None:
            return GenerationRun(endpoint, gen, **kwargs)
        wanted = (
            "prefill" if params.get("do_remote_decode")
            else "decode" if params.get("do_remote_prefill") or "recompute_token_ids" in params
            else None
        )  # fmt: skip
        if wanted != self.role:
            message = f"This {self.role} worker cannot serve {FIELD} {sorted(params)}."
            return _Refused(endpoint, gen, error=ApiError(400, message, param=FIELD), **kwargs)
        if params.get("do_remote_decode"):
            return PrefillRun(endpoint, gen, worker=self, params=params, **kwargs)
        if params.get("do_remote_prefill"):
            return DecodeRun(endpoint, gen, worker=self, params=params, **kwargs)
        try:
            gen = _recompute(gen, params["recompute_token_ids"])
        except ApiError as error:
            return _Refused(endpoint, gen, error=error, **kwargs)
        return GenerationRun(endpoint, gen, **kwargs)

    async def on_handoff(self, handoff: KVHandoff, extra: dict | None) -> None:
        """`KVReceiver`'s callback: install `handoff` and park it under its transfer id."""
        if not isinstance(extra, dict) or not isinstance(extra.get("transfer_id"), str):
            raise KVHandoffError("The handoff carries no transfer id and request parameters.")
        transfer_id = extra["transfer_id"]
        landing = self._landings.pop(transfer_id, None)  # the receiver releases it if unused
        try:
            params = params_from_json(extra["params"])
        except (KeyError, TypeError, ValueError) as exc:
            raise KVHandoffError(f"The handoff's request parameters are unusable: {exc}") from None
        engine_id = HANDOFF_PREFIX + transfer_id
        install = functools.partial(
            install_handoff, request_id=engine_id, handoff=handoff, params=params,
            priority=extra.get("priority") or 0, cache_salt=extra.get("cache_salt"),
            tenant=extra.get("tenant"), landing=None if landing is None else landing.landing,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        t_start_s = time.perf_counter()
        deadline_s = loop.time() + self.install_wait_s
        sink = _ParkedSink()
        while True:
            try:
                await self.engine_loop.call(install, request_id=engine_id, sink=sink)
                break
            except NoFreeBlocks:
                if loop.time() >= deadline_s:
                    raise
                await asyncio.sleep(0.05)  # blocks free as running requests finish
        install_ms = round((time.perf_counter() - t_start_s) * 1e3, 3)
        expiry = loop.call_later(self.park_timeout_s, self._expire, transfer_id)
        self.parked[transfer_id] = _Parked(engine_id, params, sink, expiry, install_ms)
        self._arrivals.setdefault(transfer_id, asyncio.Event()).set()

    def _expire(self, transfer_id: str) -> None:
        parked = self.parked.pop(transfer_id, None)
        self._arrivals.pop(transfer_id, None)
        if parked is not None:
            self.engine_loop.abort(parked.engine_id)  # nobody attached: free its blocks

    async def attach(self, transfer_id: str) -> _Parked:
        """The request installed under `transfer_id`, waiting up to `park_timeout_s` for its
        handoff; ApiError 404 when it does not arrive."""
        arrived = self._arrivals.setdefault(transfer_id, asyncio.Event())
        try:
            await asyncio.wait_for(arrived.wait(), self.park_timeout_s)
        except TimeoutError:
            raise ApiError(
                404, f"No KV handoff arrived for transfer {transfer_id} in time.", param=FIELD
            ) from None
        finally:
            if not arrived.is_set():
                self._arrivals.pop(transfer_id, None)
        parked = self.parked.pop(transfer_id, None)
        self._arrivals.pop(transfer_id, None)
        if parked is None:
            raise ApiError(409, f"Transfer {transfer_id} was already attached.", param=FIELD)
        parked.expiry.cancel()
        return parked


class _Refused(GenerationRun):
    """A run whose body was refused before admission: `submit` raises its error."""

    def __init__(self, endpoint, gen, *, error: ApiError, **kwargs) -> None:
        super().__init__(endpoint, gen, **kwargs)
        self.error = error

    async def submit(self) -> None:
        raise self.error


def _recompute(gen, token_ids: object):
    """`gen` continuing after `token_ids`, which it prefills as part of its prompt."""
    max_tokens = gen.params.max_tokens
    if (
        not isinstance(token_ids, list)
        or not token_ids
        or not all(type(t) is int and t >= 0 for t in token_ids)
        or len(token_ids) >= max_tokens
        or len(gen.prompts) != 1
    ):
        raise ApiError(
            400,
            f"{FIELD}.recompute_token_ids must be a non-empty list of token ids, fewer than "
            "max_tokens, for a single prompt.",
            param=FIELD,
        )
    params = dataclasses.replace(
        gen.params,
        max_tokens=max_tokens - len(token_ids),
        min_tokens=max(0, gen.params.min_tokens - len(token_ids)),
    )
    return dataclasses.replace(gen, prompts=(gen.prompts[0] + tuple(token_ids),), params=params)


async def serve_worker(
    config: ServerConfig,
    role: str,
    name: str,
    *,
    on_listening,
    stop: asyncio.Event | None = None,
    park_timeout_s: float = 30.0,
    install_wait_s: float = 10.0,
) -> None:
    """Serve `config` as a `role` worker until `stop`; `on_listening(url, kv_port)` once bound
    (`kv_port` None for a prefill worker)."""
    if config.engine_loop != "thread":
        raise ServerError("P/D workers run the engine in thread mode (--engine-loop thread).")

    def build() -> Any:
        try:
            engine = build_engine(config.engine)
        except EngineError as exc:
            raise ServerError(str(exc)) from None
        return HandoffEngine(engine) if role == "prefill" else engine

    engine_loop = ThreadEngineLoop(build=build)
    worker = PDWorker(
        role, name, engine_loop, config,
        park_timeout_s=park_timeout_s, install_wait_s=install_wait_s,
    )  # fmt: skip
    receiver = None
    if role == "decode":
        receiver = KVReceiver(  # on the server's address: a Ray node's, or loopback
            worker.on_handoff, host=config.host, with_extra=True, staging=worker.staging,
            on_header=worker.on_header,
        )  # fmt: skip
        await receiver.start()
    kv_port = None if receiver is None else receiver.port
    try:
        await serve(
            config,
            engine_loop=engine_loop,
            run_factory=worker.make_run,
            on_listening=lambda url: on_listening(url, kv_port),
            stop=stop,
        )
    finally:
        if receiver is not None:
            await receiver.close()
