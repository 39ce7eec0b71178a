"""The KV link over TCP: `send_handoff` writes a handoff's frames (`kv_link.encode`) to a
`KVReceiver`, which decodes them as they arrive (`kv_link.HandoffDecoder`: each block's checksum
verified as soon as the block is complete), hands only verified handoffs to its callback and
replies one JSON line, so the sender learns whether the handoff was installed or why not.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass

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
__all__ = ["FrameTransform", "KVReceiver", "send_handoff"]

_READ_CHUNK = 1 << 20


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close a connection; a peer already gone (reset) is not an error here."""
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass


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
    With `with_extra`, `on_handoff(handoff, extra)` also gets the sender's `extra` (or None)."""

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

    def __post_init__(self) -> None:
        self._server: asyncio.Server | None = None

    async def start(self) -> KVReceiver:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> KVReceiver:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reply: dict = {"ok": True}
        decoder = HandoffDecoder(max_bytes=self.max_bytes, staging=self.staging)
        try:
            while not decoder.done:
                chunk = await asyncio.wait_for(reader.read(_READ_CHUNK), self.timeout_s)
                if not chunk:
                    break
                decoder.feed(chunk)
            handoff = decoder.result()  # KVLinkCut unless every block arrived and passed
            args = (handoff, decoder.extra) if self.with_extra else (handoff,)
            result = self.on_handoff(*args)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # replied to the sender, never raised into the server
            if isinstance(exc, TimeoutError):
                exc = KVLinkError(f"The KV transfer stalled for more than {self.timeout_s} s.")
            reply = {"ok": False, "kind": type(exc).__name__, "error": str(exc)}
            if self.on_error is not None:
                self.on_error(exc)
            if isinstance(exc, KVLinkError):
                await self._discard_rest(reader)
        finally:
            handoff = args = None  # `on_handoff` is done with the blocks: their area is free
            decoder.release_area()
        try:
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except OSError:
            pass  # the sender is gone (a cut transfer): nothing to tell
        finally:
            await _close(writer)

    async def _discard_rest(self, reader: asyncio.StreamReader) -> None:
        """Read what the sender still sends after a failed block, up to `max_bytes`, so the
        reply reaches it (closing with unread input would reset the connection and drop it)."""
        left = self.max_bytes
        try:
            while left > 0 and (chunk := await asyncio.wait_for(reader.read(_READ_CHUNK), 1.0)):
                left -= len(chunk)
        except (TimeoutError, OSError):
            pass
