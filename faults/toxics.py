"""Toxics: the faults the TCP proxy (`faults.proxy`) injects, declared as validated data, and
`ToxicPipe`, which applies them to the bytes of one direction of one connection.

A toxic is one kind of fault, the direction it acts in and the fraction of connections it
affects, with kind-specific parameters (named with their units). The kinds follow Toxiproxy's
toxics; `stall` is Toxiproxy's `timeout` with no timeout and `down` its disabled proxy (which
acts on the listener, so the proxy handles it, not a pipe).
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from faults.plan_checks import is_number

TOXIC_KINDS = ("latency", "bandwidth", "slicer", "stall", "reset_peer", "limit_data", "down")
DIRECTIONS = ("upstream", "downstream", "both")
SHAPING_KINDS = frozenset({"latency", "bandwidth", "slicer"})  # these queue and pace data
QUEUE_HIGH_BYTES = 4 * 1024 * 1024  # bytes a shaping queue holds before reading pauses
QUEUE_LOW_BYTES = 1024 * 1024
BANDWIDTH_STEP_S = 0.01  # a bandwidth-capped pipe sends at most this much time's worth at once

# kind -> ((parameter, default or None when required, lower bound, whether the bound is strict), ...)
_PARAMS: Mapping[str, tuple[tuple[str, float | None, float, bool], ...]] = MappingProxyType(
    {
        "latency": (("latency_ms", None, 0.0, False), ("jitter_ms", 0.0, 0.0, False)),
        "bandwidth": (("rate_kbps", None, 0.0, True),),
        "slicer": (
            ("average_size", None, 1.0, False),
            ("size_variation", 0.0, 0.0, False),
            ("delay_us", 0.0, 0.0, False),
        ),
        "stall": (),
        "reset_peer": (("timeout_ms", 0.0, 0.0, False),),
        "limit_data": (("bytes", None, 0.0, False),),
        "down": (("reset_open", 1.0, 0.0, False),),
    }
)


class ToxicParams(Mapping[str, float]):
    """An immutable, hashable parameter mapping (so a `Toxic` is hashable and has a stable repr)."""

    __slots__ = ("_items",)

    def __init__(self, values: Mapping[str, float]) -> None:
        self._items = tuple(sorted(values.items()))

    def __getitem__(self, key: str) -> float:
        for name, value in self._items:
            if name == key:
                return value
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{name!r}: {value!r}" for name, value in self._items) + "}"


@dataclass(frozen=True)
class Toxic:
    """One active fault.

    `direction`: `upstream` acts on client-to-server data, `downstream` on server-to-client data,
    `both` on both (ignored by `down`, which acts on the listener). `fraction` is the share of
    connections affected, drawn per connection from the proxy's seed (see `FaultProxy`).
    `params` (missing optional ones get their defaults):
    - latency: `latency_ms` (>= 0), `jitter_ms` (>= 0, default 0): each piece of data is delayed
      by latency plus uniform jitter in [-jitter, +jitter] (never below 0), order kept.
    - bandwidth: `rate_kbps` (> 0, kilobits, i.e. 125 bytes, per second), per connection and
      direction.
    - slicer: `average_size` (bytes, >= 1), `size_variation` (bytes, default 0, below
      average_size), `delay_us` (default 0): data is cut into pieces of average_size +/- uniform
      variation, with delay_us between pieces.
    - stall: no parameters; nothing is forwarded while it is active, nothing is dropped.
    - reset_peer: `timeout_ms` (>= 0, default 0): this long after the first data in the
      direction (0: at that data, which is not forwarded), both sockets are closed with RST.
    - limit_data: `bytes` (>= 0): after that many bytes in the direction (counted from when the
      toxic met the connection) the connection is closed cleanly (FIN both ways).
    - down: `reset_open` (0 or 1, default 1): the listener is closed, so new connections are
      refused (ECONNREFUSED); with reset_open=1 open connections are reset too, as when the
      target's process dies (a client's keep-alive pool would otherwise carry on). `fraction`
      must be 1.
    """

    kind: str
    direction: str = "downstream"
    fraction: float = 1.0
    params: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in TOXIC_KINDS:
            raise ValueError(
                f"kind {self.kind!r} is not a toxic; known kinds: {', '.join(TOXIC_KINDS)}."
            )
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction {self.direction!r} is not one of {', '.join(DIRECTIONS)}.")
        if not is_number(self.fraction) or not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction must be a number from 0 to 1, not {self.fraction!r}.")
        if self.kind == "down" and self.fraction != 1.0:
            raise ValueError(
                "fraction must be 1 for down (a listener is open or closed); "
                "use reset_peer with timeout_ms=0 for a partial outage."
            )
        object.__setattr__(self, "fraction", float(self.fraction))
        object.__setattr__(self, "params", ToxicParams(_validated(self.kind, self.params)))

    def acts_on(self, direction: str) -> bool:
        """True when this toxic acts on data flowing in `direction` (upstream or downstream)."""
        return self.direction in (direction, "both")

    def is_chosen(self, seed: int, connection_id: int) -> bool:
        """Whether connection number `connection_id` is affected, drawn from `seed`.

        The draw depends only on (seed, connection number, this toxic), so a rerun chooses the
        same connections, and so does activating the same toxic again later.
        """
        if self.fraction >= 1.0:
            return True
        return random.Random(f"{seed}/{connection_id}/{self!r}").random() < self.fraction


def check_toxic_set(toxics: Sequence[Toxic]) -> None:
    """Reject a set with two toxics of one kind acting in one direction (their effect would be
    ambiguous), in one sentence."""
    seen: set[tuple[str, str]] = set()
    for toxic in toxics:
        if not isinstance(toxic, Toxic):
            raise ValueError(f"toxics must be Toxic objects, not {type(toxic).__name__}.")
        directions = ("listener",) if toxic.kind == "down" else ("upstream", "downstream")
        for direction in directions:
            if direction != "listener" and not toxic.acts_on(direction):
                continue
            key = (toxic.kind, direction)
            if key in seen:
                raise ValueError(
                    f"two {toxic.kind} toxics act {key[1]}; give one toxic per kind and direction."
                )
            seen.add(key)


def _validated(kind: str, params: Mapping[str, float]) -> dict[str, float]:
    if not isinstance(params, Mapping):
        raise ValueError(
            f"params must be a mapping of names to numbers, not {type(params).__name__}."
        )
    spec = _PARAMS[kind]
    names = [name for name, *_ in spec]
    unknown = sorted(set(params) - set(names))
    if unknown:
        known = ", ".join(names) or "none"
        raise ValueError(f"{kind} has no parameter {unknown[0]!r}; its parameters: {known}.")
    values: dict[str, float] = {}
    for name, default, lower, strict in spec:
        value = params.get(name, default)
        if value is None:
            raise ValueError(f"{kind} needs the parameter {name}.")
        if not is_number(value) or value < lower or (strict and value == lower):
            bound = f"> {lower:g}" if strict else f">= {lower:g}"
            raise ValueError(
                f"{kind} parameter {name} must be a finite number {bound}, not {value!r}."
            )
        values[name] = float(value)
    if kind == "slicer" and values["size_variation"] >= values["average_size"]:
        raise ValueError("slicer parameter size_variation must be smaller than average_size.")
    if kind == "down" and values["reset_open"] not in (0.0, 1.0):
        raise ValueError("down parameter reset_open must be 0 or 1.")
    return values


class Endpoint(Protocol):
    """A socket of a connection; `transport` is None until it is connected."""

    transport: asyncio.Transport | None


class PipeOwner(Protocol):
    """What a pipe asks of the connection it belongs to."""

    def reset(self, by_toxic: bool) -> None:
        """Close both sockets with RST."""

    def close(self, *, limited: bool) -> None:
        """Close both sockets cleanly, after what is already written."""

    def half_closed(self) -> None:
        """A pipe passed its sender's FIN on."""

    def forwarded(self, direction: str, num_bytes: int) -> None:
        """A pipe wrote `num_bytes` to its receiver."""


class _Marker:
    """A queued event that is not data; it keeps its place in the order of the stream."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_EOF = _Marker("eof")  # the sender half-closed: pass the FIN on
_CLOSED = _Marker("closed")  # the sender's socket closed: close the connection cleanly
_LIMIT = _Marker("limit")  # limit_data reached: close the connection cleanly
_RESET = _Marker("reset")  # the sender's socket was reset: reset the connection


class ToxicPipe:
    """One direction of a connection: applies that direction's toxics to what is read from
    `src` and writes it to `dst`.

    With no shaping toxic and nothing queued, `feed` writes straight to `dst` (the idle path).
    Otherwise data is queued with the loop time it is due (arrival + latency, never before the
    data ahead of it) and a writer task slices, paces and writes it. Reading from `src` pauses
    while the pipe is stalled, `dst` is full, the queue holds over QUEUE_HIGH_BYTES, or for any
    other reason given to `set_paused`.
    """

    def __init__(
        self, owner: PipeOwner, direction: str, src: Endpoint, dst: Endpoint, rng: random.Random
    ) -> None:
        self.owner = owner
        self.direction = direction
        self.src = src
        self.dst = dst
        self.rng = rng  # latency jitter and slice sizes
        self.loop = asyncio.get_running_loop()
        self.toxics: dict[str, Toxic] = {}
        self.queue: deque[tuple[float, bytes | _Marker]] = deque()  # (due at loop time, item)
        self.queued_bytes = 0
        self.last_due_at = 0.0
        self.bandwidth_free_at = 0.0
        self.limit_count = 0  # bytes taken in since limit_data met this pipe
        self.reset_timer: asyncio.TimerHandle | None = None
        self.pause_reasons: set[str] = set()
        self.stalled = False
        self.dst_full = False
        self.gate = (
            asyncio.Event()
        )  # set while writing may go on: dst connected, not full, no stall
        self.wake = asyncio.Event()
        self.writer: asyncio.Task | None = None
        self.eof_sent = False
        self.stopped = False  # the connection closed, or `dst` is gone

    def set_toxics(self, toxics: Sequence[Toxic]) -> None:
        """Make `toxics` (those chosen for this connection) the active ones for this direction.
        A toxic kept from the previous set keeps its state (limit_data's count, reset's timer)."""
        old = self.toxics
        self.toxics = {t.kind: t for t in toxics if t.kind != "down" and t.acts_on(self.direction)}
        if old.get("limit_data") != self.toxics.get("limit_data"):
            self.limit_count = 0
        if old.get("reset_peer") != self.toxics.get("reset_peer") and self.reset_timer is not None:
            self.reset_timer.cancel()
            self.reset_timer = None
        self.stalled = "stall" in self.toxics
        self.set_paused("stall", self.stalled)
        self.update_gate()

    @property
    def is_direct(self) -> bool:
        """True when data can go straight to `dst` (nothing queued, nothing to shape)."""
        return (
            not self.queue
            and not self.stalled
            and self.dst.transport is not None
            and SHAPING_KINDS.isdisjoint(self.toxics)
        )

    # -- what the sender did ---------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        """Take data read from `src`."""
        if self.stopped:
            return
        reset = self.toxics.get("reset_peer")
        if reset is not None:
            timeout_s = reset.params["timeout_ms"] / 1e3
            if timeout_s == 0:
                self.owner.reset(by_toxic=True)
                return
            if self.reset_timer is None:
                self.reset_timer = self.loop.call_later(timeout_s, self.owner.reset, True)
        at_limit = False
        limit = self.toxics.get("limit_data")
        if limit is not None:
            room = int(limit.params["bytes"]) - self.limit_count
            if len(data) >= room:
                data, at_limit = data[: max(room, 0)], True
            self.limit_count += len(data)
        if self.is_direct:
            if data:
                self._write(data)
            if at_limit:
                self.owner.close(limited=True)
            return
        if data:
            self._enqueue(data)
        if at_limit:
            self._enqueue(_LIMIT)

    def feed_eof(self) -> None:
        """`src` half-closed: pass the FIN on, in stream order."""
        self._feed_marker(_EOF)

    def feed_lost(self, *, was_reset: bool) -> None:
        """`src` is gone: close (or reset) the connection, after what it already sent."""
        self._feed_marker(_RESET if was_reset else _CLOSED)

    def _feed_marker(self, marker: _Marker) -> None:
        if self.stopped:
            return
        if self.is_direct:
            self._act(marker)
        else:
            self._enqueue(marker)

    # -- flow control ----------------------------------------------------------------------------
    def set_paused(self, reason: str, paused: bool) -> None:
        """Pause or resume reading from `src`, which stays paused while any reason holds."""
        if paused:
            self.pause_reasons.add(reason)
        else:
            self.pause_reasons.discard(reason)
        self.sync_reading()

    def sync_reading(self) -> None:
        """Make `src`'s transport read, or not, as the pause reasons say."""
        transport = self.src.transport
        if transport is None or transport.is_closing():
            return
        if self.pause_reasons:  # both calls are no-ops when already in that state
            transport.pause_reading()
        else:
            transport.resume_reading()

    def set_dst_full(self, full: bool) -> None:
        """`dst`'s write buffer crossed its high (True) or low (False) water mark."""
        self.dst_full = full
        self.set_paused("backpressure", full)
        self.update_gate()

    def update_gate(self) -> None:
        if self.stalled or self.dst_full or self.dst.transport is None:
            self.gate.clear()
        else:
            self.gate.set()

    def stop(self) -> None:
        """Drop what is queued and stop the writer (the connection is closing)."""
        self.stopped = True
        if self.reset_timer is not None:
            self.reset_timer.cancel()
        if self.writer is not None and self.writer is not asyncio.current_task():
            self.writer.cancel()
        self.queue.clear()

    # -- writing ---------------------------------------------------------------------------------
    def _write(self, data: bytes) -> None:
        transport = self.dst.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)
            self.owner.forwarded(self.direction, len(data))

    def _act(self, marker: _Marker) -> None:
        if marker is _EOF:
            self.eof_sent = True
            transport = self.dst.transport
            if transport is not None and not transport.is_closing() and transport.can_write_eof():
                try:
                    transport.write_eof()
                except OSError:  # the receiver is gone already (ENOTCONN): nothing to half-close
                    self.owner.close(limited=False)
                    return
            self.owner.half_closed()
        elif marker is _CLOSED or marker is _LIMIT:
            self.owner.close(limited=marker is _LIMIT)
        else:
            self.owner.reset(by_toxic=False)

    def _enqueue(self, item: bytes | _Marker) -> None:
        now = self.loop.time()
        due_at = now
        latency = self.toxics.get("latency")
        if latency is not None and isinstance(item, bytes):
            jitter_ms = latency.params["jitter_ms"]
            delay_ms = latency.params["latency_ms"] + self.rng.uniform(-jitter_ms, jitter_ms)
            due_at = now + max(delay_ms, 0.0) / 1e3
        due_at = max(due_at, self.last_due_at)  # keeps the order within the pipe
        self.last_due_at = due_at
        self.queue.append((due_at, item))
        if isinstance(item, bytes):
            self.queued_bytes += len(item)
            if self.queued_bytes > QUEUE_HIGH_BYTES:
                self.set_paused("queue", True)
        if self.writer is None:
            self.writer = self.loop.create_task(self._drain())
        self.wake.set()

    async def _drain(self) -> None:
        try:
            while not self.stopped:
                if not self.queue:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                due_at, item = self.queue[0]
                delay_s = due_at - self.loop.time()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                await self.gate.wait()
                if isinstance(item, _Marker):
                    self.queue.popleft()
                    self._act(item)
                    continue
                await self._send_shaped(item)
                self.queue.popleft()  # only now, so that new data queues behind this item
                self.queued_bytes -= len(item)
                if self.queued_bytes < QUEUE_LOW_BYTES:
                    self.set_paused("queue", False)
        except Exception:
            self.owner.reset(by_toxic=False)  # a broken pipe must not leave a connection half alive
            raise

    async def _send_shaped(self, data: bytes) -> None:
        slicer = self.toxics.get("slicer")
        pieces = self._slices(data, slicer) if slicer is not None else [data]
        for piece in pieces:
            bandwidth = self.toxics.get("bandwidth")
            if bandwidth is None:
                await self.gate.wait()
                self._write(piece)
            else:
                await self._send_paced(piece, bandwidth.params["rate_kbps"] * 125.0)
            if slicer is not None and slicer.params["delay_us"] > 0:
                await asyncio.sleep(slicer.params["delay_us"] / 1e6)
            if self.stopped:
                return

    async def _send_paced(self, piece: bytes, rate_bytes_per_s: float) -> None:
        step = int(min(max(rate_bytes_per_s * BANDWIDTH_STEP_S, 1), 1 << 16))
        for start in range(0, len(piece), step):
            part = piece[start : start + step]
            # The part is on the wire for len/rate: forward it when that time is over.
            free_at = max(self.loop.time(), self.bandwidth_free_at) + len(part) / rate_bytes_per_s
            self.bandwidth_free_at = free_at
            await asyncio.sleep(max(free_at - self.loop.time(), 0.0))
            await self.gate.wait()
            self._write(part)

    def _slices(self, data: bytes, slicer: Toxic) -> list[bytes]:
        average = slicer.params["average_size"]
        variation = slicer.params["size_variation"]
        pieces, start = [], 0
        while start < len(data):
            size = max(1, round(average + self.rng.uniform(-variation, variation)))
            pieces.append(data[start : start + size])
            start += size
        return pieces
