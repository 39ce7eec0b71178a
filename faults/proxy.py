"""The fault proxy: an asyncio TCP proxy on loopback between the client and the target.

Each accepted connection is a link of two sockets and two pipes, `upstream` (client to server)
and `downstream` (server to client). With no toxic active a pipe writes what it reads straight to
the other socket inside the read callback: no task hop, no sleep, 256 KiB reads, TCP_NODELAY on
both sockets, backpressure by pausing the reading side. A pipe with a shaping toxic (latency,
bandwidth, slicer) queues timestamped data for a writer task that delays, slices and paces it;
once that queue is empty again and no shaping toxic is left, the pipe is back on the direct path.

Toxics and connections: `set_toxics` replaces the active set, and every link, the open ones
included, is subject to each toxic whose seeded draw chooses it (`Toxic.is_chosen`: the draw
depends on the proxy's seed, the connection's number in accept order and the toxic, so a rerun
picks the same connections). Data already queued keeps the delay it was given; everything read
from then on sees the new set.

What a client sees (status / error class, as `harness.http.client` classifies it):
- `down`: the listener is closed and a bound, non-listening socket holds the port, so connects
  fail with ECONNREFUSED (`error` / `connection_refused`); with `reset_open` open links are
  reset too.
- `reset_peer`: both sockets are closed with SO_LINGER 0, i.e. RST (`unknown` /
  `connection_reset`: the request went out, the server may have done the work).
- `limit_data`: a clean close mid-response; aiohttp reports the cut HTTP body as a payload error
  or a disconnect, both `unknown` / `connection_reset` (never `incomplete_stream`, which needs a
  complete HTTP body without `[DONE]`).
- `stall`: nothing arrives, the connection stays open; the client's timeout fires (`timeout`).
- an unreachable upstream: the client's connection is reset (counted as `refused` in `stats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from faults.toxics import TOXIC_KINDS, Toxic, ToxicPipe, check_toxic_set

__all__ = ["TOXIC_KINDS", "FaultProxy", "Toxic"]

WRITE_BUFFER_HIGH = 256 * 1024  # bytes a socket's write buffer holds before the reader pauses
_LINGER_RST = struct.pack("ii", 1, 0)


@dataclass
class _Counters:
    accepted: int = 0
    refused: int = 0  # accepted, then reset because the upstream could not be reached
    reset: int = 0  # reset by reset_peer or down
    limited: int = 0  # closed by limit_data
    bytes_upstream: int = 0
    bytes_downstream: int = 0


class _Side(asyncio.Protocol):
    """One socket of a link: what it reads goes into the pipe leaving it; its write
    backpressure pauses the pipe entering it."""

    def __init__(self, link: _Link, outgoing: str, incoming: str) -> None:
        self.link = link
        self.outgoing = outgoing
        self.incoming = incoming
        self.transport: asyncio.Transport | None = None
        self.lost = link.loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        self.link.side_made(self)
        # uvloop starts reading after connection_made returns, whatever it paused: pause again.
        self.link.loop.call_soon(self.link.pipes[self.outgoing].sync_reading)

    def data_received(self, data: bytes) -> None:
        self.link.pipes[self.outgoing].feed(data)

    def eof_received(self) -> bool:
        self.link.pipes[self.outgoing].feed_eof()
        return True  # keep the socket open for writing until the other way is done too

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        self.link.side_lost(self, exc)

    def pause_writing(self) -> None:
        self.link.pipes[self.incoming].set_dst_full(True)

    def resume_writing(self) -> None:
        self.link.pipes[self.incoming].set_dst_full(False)

    def rst(self) -> None:
        """Close this socket with RST instead of FIN."""
        if self.transport is None or self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        self.transport.abort()


class _Link:
    """One client connection and the upstream connection opened for it."""

    def __init__(self, proxy: FaultProxy, link_id: int) -> None:
        self.proxy = proxy
        self.link_id = link_id
        self.loop = asyncio.get_running_loop()
        self.client = _Side(self, outgoing="upstream", incoming="downstream")
        self.server = _Side(self, outgoing="downstream", incoming="upstream")
        self.pipes = {
            direction: ToxicPipe(
                self, direction, src, dst, random.Random(f"{proxy.seed}/{link_id}/{direction}")
            )
            for direction, src, dst in (
                ("upstream", self.client, self.server),
                ("downstream", self.server, self.client),
            )
        }
        self.closed = False
        self.connect_task: asyncio.Task | None = None

    def side_made(self, side: _Side) -> None:
        if side is self.server:
            self.pipes["upstream"].update_gate()
            return
        self.proxy._counters.accepted += 1
        self.proxy._links[self.link_id] = self
        if self.proxy._stopping:
            self.reset(by_toxic=False)
            return
        self.pipes["upstream"].set_paused("connecting", True)
        self.apply(self.proxy._chosen_toxics(self.link_id))
        self.connect_task = self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            await self.loop.create_connection(
                lambda: self.server, self.proxy.upstream_host, self.proxy.upstream_port
            )
        except OSError:
            self.proxy._counters.refused += 1
            self.reset(by_toxic=False)
            return
        if self.closed:
            self.server.rst()
            return
        self.pipes["upstream"].set_paused("connecting", False)

    def apply(self, toxics: Sequence[Toxic]) -> None:
        for pipe in self.pipes.values():
            pipe.set_toxics(toxics)

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        if self.closed:
            self._forget()
            return
        # Pass the loss on in stream order: after what that side already sent.
        self.pipes[side.outgoing].feed_lost(was_reset=exc is not None)
        self.pipes[side.incoming].stop()

    def half_closed(self) -> None:
        if self.pipes["upstream"].eof_sent and self.pipes["downstream"].eof_sent:
            self.close(limited=False)

    def forwarded(self, direction: str, num_bytes: int) -> None:
        if direction == "upstream":
            self.proxy._counters.bytes_upstream += num_bytes
        else:
            self.proxy._counters.bytes_downstream += num_bytes

    def close(self, *, limited: bool) -> None:
        """Close both sockets cleanly (FIN, after what is already written)."""
        if self._finish():
            if limited:
                self.proxy._counters.limited += 1
            for side in (self.client, self.server):
                if side.transport is not None and not side.transport.is_closing():
                    side.transport.close()

    def reset(self, by_toxic: bool) -> None:
        """Close both sockets with RST."""
        if self._finish():
            if by_toxic:
                self.proxy._counters.reset += 1
            self.client.rst()
            self.server.rst()

    def _finish(self) -> bool:
        if self.closed:
            return False
        self.closed = True
        for pipe in self.pipes.values():
            pipe.stop()
        if self.connect_task is not None and self.connect_task is not asyncio.current_task():
            self.connect_task.cancel()
        self._forget()
        return True

    def _forget(self) -> None:
        if all(side.transport is None or side.lost.done() for side in (self.client, self.server)):
            self.proxy._links.pop(self.link_id, None)

    async def wait_closed(self) -> None:
        if self.connect_task is not None:
            await asyncio.gather(self.connect_task, return_exceptions=True)
        await asyncio.gather(
            *(side.lost for side in (self.client, self.server) if side.transport is not None)
        )


class FaultProxy:
    """A TCP proxy from `listen_host:url_port` to `upstream_host:upstream_port` that injects the
    active toxics. Use `async with FaultProxy(...) as proxy:` (or `start`/`stop`) inside the
    running loop, and call `set_toxics` from that loop's thread."""

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int = 0,
    ) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.listen_host = listen_host
        self.seed = seed
        self._counters = _Counters()
        self._links: dict[int, _Link] = {}
        self._stopping = False
        self._port = listen_port
        self._toxics: tuple[Toxic, ...] = ()
        self._next_id = 0
        self._server: asyncio.Server | None = None
        self._serve_task: asyncio.Task | None = None
        self._placeholder: socket.socket | None = None  # holds the port while down
        self._pending_sock: socket.socket | None = None  # listening, not yet served
        self._started = False

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    @property
    def url_port(self) -> int:
        """The port the client should connect to (known once started)."""
        return self._port

    @property
    def toxics(self) -> tuple[Toxic, ...]:
        """The active set, as last given to `set_toxics`."""
        return self._toxics

    @property
    def stats(self) -> dict:
        """Counters since start: `accepted`, `refused` (upstream unreachable), `reset` (by a
        toxic), `limited` (closed by limit_data), `bytes_upstream`, `bytes_downstream`
        (forwarded), and `open` links. Attempts refused while `down` never reach the proxy."""
        return {**asdict(self._counters), "open": len(self._links)}

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("the proxy is already started")
        self._started = True
        if self._is_down:
            self._placeholder = self._bind(self._port)
            self._port = self._placeholder.getsockname()[1]
        else:
            await self._serve(self._listen())

    async def stop(self) -> None:
        """Stop listening, reset every open link and wait until their sockets are closed."""
        self._stopping = True
        server = self._server
        self._close_listener()
        if self._serve_task is not None:
            await asyncio.gather(self._serve_task, return_exceptions=True)
        if self._placeholder is not None:
            self._placeholder.close()
            self._placeholder = None
        links = list(self._links.values())
        for link in links:
            link.reset(by_toxic=False)
        if links:
            await asyncio.wait_for(asyncio.gather(*(link.wait_closed() for link in links)), 5.0)
        self._links.clear()
        if server is not None:
            await server.wait_closed()

    def set_toxics(self, toxics: Sequence[Toxic]) -> None:
        """Replace the active set at once; every link, the open ones included, is subject to each
        toxic its seeded draw chooses. Raises ValueError for an ambiguous set."""
        toxics = tuple(toxics)
        check_toxic_set(toxics)
        was_down = self._is_down
        self._toxics = toxics
        down = next((t for t in toxics if t.kind == "down"), None)
        if self._started and not self._stopping:
            if down is not None and not was_down:
                self._go_down(reset_open=down.params["reset_open"] == 1.0)
            elif down is None and was_down:
                self._go_up()
        for link in list(self._links.values()):
            if not link.closed:
                link.apply(self._chosen_toxics(link.link_id))

    def _chosen_toxics(self, link_id: int) -> list[Toxic]:
        return [t for t in self._toxics if t.kind != "down" and t.is_chosen(self.seed, link_id)]

    @property
    def _is_down(self) -> bool:
        return any(t.kind == "down" for t in self._toxics)

    def _accept(self) -> asyncio.Protocol:
        link = _Link(self, self._next_id)
        self._next_id += 1
        return link.client

    def _bind(self, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.listen_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.listen_host, port))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    def _listen(self) -> socket.socket:
        """Bind and listen on the port now (taking it over from the placeholder, if any):
        connects from here on wait in the kernel's accept queue until the server runs."""
        sock = self._bind(self._port)
        try:
            sock.listen(socket.SOMAXCONN)
        except OSError:
            sock.close()
            raise
        self._port = sock.getsockname()[1]
        if self._placeholder is not None:
            self._placeholder.close()
            self._placeholder = None
        self._pending_sock = sock
        return sock

    async def _serve(self, sock: socket.socket) -> None:
        # Nothing suspends before `self._server` is set; a stop or `down` before this task's
        # first step closes `_pending_sock` instead.
        loop = asyncio.get_running_loop()
        try:
            server = await loop.create_server(self._accept, sock=sock, start_serving=False)
        except BaseException:
            sock.close()
            raise
        self._pending_sock = None
        self._server = server
        await server.start_serving()

    def _close_listener(self) -> None:
        if self._serve_task is not None and not self._serve_task.done():
            self._serve_task.cancel()
        if self._pending_sock is not None:
            self._pending_sock.close()
            self._pending_sock = None
        server, self._server = self._server, None
        if server is not None:
            server.close()  # closes the listening socket now: new connects are refused

    def _go_down(self, *, reset_open: bool) -> None:
        self._close_listener()
        self._placeholder = self._bind(self._port)
        if reset_open:
            for link in list(self._links.values()):
                link.reset(by_toxic=True)

    def _go_up(self) -> None:
        sock = self._listen()
        self._serve_task = asyncio.get_running_loop().create_task(self._serve(sock))
