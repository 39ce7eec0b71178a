"""The KV link over TCP: `send_handoff` writes a handoff's frames (`kv_link.encode`) to a
`KVReceiver`, which reads them straight into the decoder's area (`HandoffDecoder.writable`),
verifies each block's checksum as soon as the block is complete, hands only verified handoffs
to its callback and replies one JSON line, so the sender learns whether the handoff was
installed or why not. With `on_header`, the receiver also lands verified blocks in blocks
reserved for them (`core.kv_landing`) while the rest arrives, so the install after the last
block has little left to copy.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from engine_ref.cluster.kv_link import (
    DEFAULT_MAX_BYTES,
    MAX_HEADER_BYTES,
    HandoffDecoder,
    KVHandoff,
    KVLinkCut,
    KVLinkError,
    KVTransferRejected,
    StagingBuffers,
    encode,
)

# (KVHandoff and StagingBuffers via kv_link: the cluster reaches the core through it alone.)
__all__ = ["FrameTransform", "KVReceiver", "Landing", "send_handoff"]

# Verified blocks written to a landing at a time (16 SmolLM2 blocks: 5.9 MB), and one at a
# time for the last LAND_BATCH: whatever is not landed when the last byte arrives is copied
# before the reply.
LAND_BATCH = 16
_READ_CHUNK = 1 << 16  # reads dropped after the end or a failure


class Landing(Protocol):
    """Where a receiver writes verified blocks before the install (`KVReceiver.on_header`)."""

    written: int  # blocks written so far

    def write(self, first: int, blocks: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Blocks `first`, `first + 1`, ... (kv, scales), in order."""

    def release(self) -> None:
        """The transfer failed: give the reserved blocks back."""


# Rewrites a handoff's frames on their way to the socket (`send_handoff`'s fault seam).
FrameTransform = Callable[[Iterator[bytes | memoryview]], Iterable[bytes | memoryview]]


async def send_handoff(
    host: str,
    port: int,
    handoff: KVHandoff,
    *,
    timeout_s: float = 30.0,
    extra: dict | None = None,
    transform: FrameTransform | None = None,
) -> None:
    """Send `handoff` (with `extra`: `encode`) to a `KVReceiver` and wait for its reply.
    Raises KVTransferRejected when the receiver did not take it (its reason: a block that
    failed its checksum, the install's error), KVLinkCut when the connection ends without a
    reply, OSError when it cannot connect, TimeoutError past `timeout_s` for any one wait.
    `transform` rewrites the frames on their way: the seam a fault plugs into (a flipped bit)."""
    loop = asyncio.get_running_loop()
    sock = await asyncio.wait_for(_connect(loop, host, port), timeout_s)
    try:
        frames = encode(handoff) if extra is None else encode(handoff, extra=extra)
        # Straight from the frames' views to the socket: a stream writer copies what the
        # socket does not take at once into its own buffer, most of 47 MB for a 2,048-token
        # SmolLM2 handoff, where `sock_sendall` waits and sends from the view.
        for chunk in frames if transform is None else transform(frames):
            await asyncio.wait_for(loop.sock_sendall(sock, chunk), timeout_s)
        sock.shutdown(socket.SHUT_WR)
        line = await asyncio.wait_for(_read_line(loop, sock), timeout_s)
    except ConnectionError:
        line = b""  # the receiver went away mid-transfer: no reply
    finally:
        sock.close()
    if not line:
        raise KVLinkCut(0, "the receiver's reply")
    reply = json.loads(line)
    if not reply.get("ok"):
        raise KVTransferRejected(str(reply.get("kind")), str(reply.get("error")))


async def _connect(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket connected to `host`:`port` (the first address that takes it;
    OSError, as `asyncio.open_connection` raises, when none does)."""
    error: OSError | None = None
    for family, kind, proto, _, address in await loop.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    ):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error or OSError(f"Cannot resolve {host}:{port}.")


async def _read_line(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """The peer's reply: bytes up to the first newline, or all it sent before closing."""
    data = b""
    while b"\n" not in data and len(data) < MAX_HEADER_BYTES:
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0]


@dataclass
class KVReceiver:
    """A TCP server on `host`:`port` (0: a free port, `port` once started) receiving handoffs.
    `on_handoff` (plain or async) gets each verified handoff and installs it; what it raises is
    replied to the sender (class name and message). A transfer that fails verification, is cut,
    or stalls past `timeout_s` never reaches `on_handoff`; `on_error`, if given, sees its error.
    With `with_extra`, `on_handoff(handoff, extra)` also gets the sender's `extra` (or None).

    The socket reads straight into the decoder's area (`HandoffDecoder.writable`): after the
    header, each read lands where the bytes belong and the blocks it completes are verified
    while the sender sends on, so nothing is copied on this side but by the socket itself."""

    on_handoff: Callable[..., object | Awaitable[object]]
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 30.0
    max_bytes: int = DEFAULT_MAX_BYTES
    on_error: Callable[[Exception], None] | None = None
    with_extra: bool = False
    # Reuse the buffers transfers are read into (`core.staging`): then a handoff's blocks are
    # valid only until `on_handoff` returns (an install copies them out).
    staging: StagingBuffers | None = None
    # Land blocks while the rest arrives: `on_header(header, extra)` (async) runs once the
    # header has arrived and returns None or a landing (`write(first, blocks)`, `release()`);
    # each verified block is then written through it (LAND_BATCH at a time, the rest before
    # `on_handoff`), and a transfer that fails releases it. `on_handoff` finds it by itself.
    on_header: Callable[[dict, dict | None], Awaitable[Landing | None]] | None = None

    def __post_init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> KVReceiver:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Transfer(self), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._tasks):
            await asyncio.gather(task, return_exceptions=True)

    async def __aenter__(self) -> KVReceiver:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class _Transfer(asyncio.BufferedProtocol):
    """One connection of a `KVReceiver`: reading, then installing (`on_handoff` runs), then
    replied; or failed, then discarding what the sender still sends (up to `max_bytes`, so
    the reply is not lost to a reset) until it half-closes or goes quiet for a second."""

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver
        self.decoder = HandoffDecoder(max_bytes=receiver.max_bytes, staging=receiver.staging)
        self.state = "reading"  # then installing (and replied), or failed
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.last_read_s = self.loop.time()
        self.discarded = 0
        self._scratch: bytearray | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self.landing: Landing | None = None
        self._landing_task: asyncio.Task | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._arm(self.receiver.timeout_s)

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self.state == "reading" and not self.decoder.done:
            return self.decoder.writable()
        if self._scratch is None:  # past the end, or after a failure: read and dropped
            self._scratch = bytearray(_READ_CHUNK)
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self.last_read_s = self.loop.time()
        if self.state != "reading":
            self.discarded += nbytes
            if self.state == "failed" and self.discarded > self.receiver.max_bytes:
                self._close()
            return
        try:
            self.decoder.wrote(nbytes)
        except KVLinkError as exc:
            self._fail(exc)
            return
        on_header = self.receiver.on_header
        if on_header is not None and self._landing_task is None and self.decoder.header:
            decoder = self.decoder
            self._landing_task = self.loop.create_task(on_header(decoder.header, decoder.extra))
            self._landing_task.add_done_callback(self._landing_ready)
        self._land(self._batch())
        if self.decoder.done:
            self.state = "installing"
            task = self.loop.create_task(self._install())
            self.receiver._tasks.add(task)
            task.add_done_callback(self.receiver._tasks.discard)

    def eof_received(self) -> bool:
        if self.state == "reading":
            self._fail(KVLinkCut(self.decoder.received_bytes, self.decoder._where()))
        if self.state == "failed":
            self._close()  # the sender sends nothing more: the reply was its last word
        return True  # keep the write side open: the reply may still be on its way

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.state == "reading":  # reset by the sender: nobody to reply to
            self.state = "failed"
            self._release_landing()
            self._report(KVLinkCut(self.decoder.received_bytes, self.decoder._where()))
        if self.state != "installing":
            self.decoder.release_area()

    def _landing_ready(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            return  # no landing (no free blocks, say): the install writes every block
        self.landing = task.result()
        if self.state == "failed":
            self._release_landing()
        else:
            self._land(self._batch())

    def _batch(self) -> int:
        """Blocks to gather before a landing write: LAND_BATCH, then 1 for the last ones."""
        header = self.decoder.header
        left = len(header["block_nbytes"]) - len(self.decoder.verified_blocks) if header else 0
        return 1 if left <= LAND_BATCH else LAND_BATCH

    def _land(self, at_least: int) -> None:
        """Write the verified blocks not landed yet, when there are `at_least` of them."""
        landing = self.landing
        if landing is None or self.state == "failed":
            return
        blocks = self.decoder.verified_blocks
        first = landing.written
        if len(blocks) - first >= max(at_least, 1):
            landing.write(first, [(b.kv, b.scales) for b in blocks[first:]])

    def _release_landing(self) -> None:
        if self.landing is not None:
            self.landing.release()
            self.landing = None

    async def _install(self) -> None:
        receiver = self.receiver
        reply: dict = {"ok": True}
        try:
            if self._landing_task is not None:
                await asyncio.wait([self._landing_task])
                self._land(1)  # the last blocks: all landed before the install
            handoff = self.decoder.result()
            args = (handoff, self.decoder.extra) if receiver.with_extra else (handoff,)
            result = receiver.on_handoff(*args)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # replied to the sender, never raised into the server
            reply = {"ok": False, "kind": type(exc).__name__, "error": str(exc)}
            self._report(exc)
        finally:
            self._release_landing()  # a no-op for one the install took
            handoff = args = None  # `on_handoff` is done with the blocks: their area is free
            self.decoder.release_area()
        self._reply(reply)
        self._close()

    def _fail(self, exc: Exception) -> None:
        """A transfer that cannot be used: tell the sender, then drop what it still sends."""
        self.state = "failed"
        self._release_landing()
        self.decoder.release_area()
        self._report(exc)
        self._reply({"ok": False, "kind": type(exc).__name__, "error": str(exc)})
        self._arm(1.0)

    def _report(self, exc: Exception) -> None:
        if self.receiver.on_error is not None:
            self.receiver.on_error(exc)

    def _reply(self, reply: dict) -> None:
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(json.dumps(reply).encode() + b"\n")

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()  # after what is buffered (the reply) is written

    def _arm(self, delay_s: float) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = self.loop.call_later(delay_s, self._check_stall)

    def _check_stall(self) -> None:
        quiet_s = self.loop.time() - self.last_read_s
        limit_s = self.receiver.timeout_s if self.state == "reading" else 1.0
        if self.state == "installing":
            self._arm(limit_s)  # `on_handoff` runs: not the link's to time out
        elif quiet_s < limit_s:
            self._arm(limit_s - quiet_s)
        elif self.state == "reading":
            timeout_s = self.receiver.timeout_s
            self._fail(KVLinkError(f"The KV transfer stalled for more than {timeout_s} s."))
        else:
            self._close()
