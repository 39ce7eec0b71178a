"""Raw HTTP/1.1 exchanges over asyncio sockets, for requests beyond a polite HTTP client.

A body of invalid UTF-8, a 100 KiB header or a chunked 64 MiB body are written as given. Each
exchange is one `Connection: close` request, bounded by a timeout; what came back (an answer, a
closed connection, a timeout, no connection, something not HTTP) is data, never an exception.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit

JSON_TYPE = "application/json"
_HEAD_LIMIT_BYTES = 1024 * 1024
_BODY_LIMIT_BYTES = 8 * 1024 * 1024


class Outcome(StrEnum):
    ANSWERED = "answered"
    CLOSED = "closed"  # the server closed the connection before an HTTP answer
    TIMED_OUT = "timed-out"
    UNREACHABLE = "unreachable"
    NOT_HTTP = "not-http"


@dataclass(frozen=True)
class LazyBody:
    """A body generated piece by piece while it is sent; `size` None sends it chunked."""

    size: int | None
    pieces: Callable[[], Iterator[bytes]]


@dataclass(frozen=True)
class HttpAnswer:
    """What one exchange got: `status` and `body` when `outcome` is ANSWERED."""

    outcome: Outcome
    elapsed_ms: float
    status: int | None = None
    body: bytes = b""
    detail: str = ""


def no_answer_reason(what: str, answer: HttpAnswer, timeout_s: float) -> str:
    """A sentence fragment saying how `what` got no HTTP answer."""
    if answer.outcome is Outcome.TIMED_OUT:
        return f"{what} got no answer within {timeout_s:g} s"
    if answer.outcome is Outcome.UNREACHABLE:
        return f"{what} could not connect ({answer.detail})"
    return f"{what} got no HTTP answer ({answer.outcome.value.replace('-', ' ')})"


class RawServer:
    """Raw HTTP/1.1 exchanges with one server: a request written as given, the answer read."""

    def __init__(self, url: str, api_key: str | None) -> None:
        parts = urlsplit(url)
        self.is_tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.is_tls else 80)
        root = parts.path.rstrip("/")
        self.root = root[: -len("/v1")] if root.endswith("/v1") else root
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = f"{host}:{self.port}"
        self.auth = (("Authorization", f"Bearer {api_key}"),) if api_key else ()

    async def send(
        self,
        method: str,
        path: str,
        *,
        timeout_s: float,
        body: bytes | LazyBody = b"",
        content_type: str | None = JSON_TYPE,
        headers: Iterable[tuple[str, str]] = (),
    ) -> HttpAnswer:
        t0_ns = time.perf_counter_ns()
        try:
            async with asyncio.timeout(timeout_s):
                outcome, status, data, detail = await self._exchange(
                    method, path, body, content_type, headers
                )
        except TimeoutError:
            outcome, status, data, detail = Outcome.TIMED_OUT, None, b"", ""
        elapsed_ms = (time.perf_counter_ns() - t0_ns) / 1e6
        return HttpAnswer(outcome, elapsed_ms, status, data, detail)

    def _head(self, method, path, body, content_type, headers) -> bytes:
        lines = [f"{method} {self.root}{path} HTTP/1.1", f"Host: {self.host_header}"]
        lines += ["Connection: close", "Accept: */*"]
        lines += [f"{k}: {v}" for k, v in (*self.auth, *headers)]
        if content_type is not None:
            lines.append(f"Content-Type: {content_type}")
        if isinstance(body, LazyBody) and body.size is None:
            lines.append("Transfer-Encoding: chunked")
        elif isinstance(body, LazyBody) or body or method in ("POST", "PUT", "PATCH"):
            lines.append(
                f"Content-Length: {body.size if isinstance(body, LazyBody) else len(body)}"
            )
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _exchange(self, method, path, body, content_type, headers):
        context = ssl.create_default_context() if self.is_tls else None
        try:
            reader, writer = await asyncio.open_connection(
                self.host, self.port, ssl=context, limit=_HEAD_LIMIT_BYTES
            )
        except ConnectionRefusedError:
            return Outcome.UNREACHABLE, None, b"", "connection refused"
        except OSError as exc:
            return Outcome.UNREACHABLE, None, b"", exc.strerror or str(exc)
        head = self._head(method, path, body, content_type, headers)
        # The request is written while the answer is read: a server may answer (413) and stop
        # reading before a huge body is all sent.
        sender = asyncio.create_task(_write(writer, head, body))
        try:
            return await _read_answer(reader)
        finally:
            sent = sender.done() and not sender.cancelled() and sender.result()
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            if sent:
                writer.close()
            else:  # unsent bytes would hold a graceful close open
                writer.transport.abort()


async def _write(writer: asyncio.StreamWriter, head: bytes, body: bytes | LazyBody) -> bool:
    """Write the request; False when the server closed the connection before it all went."""
    try:
        writer.write(head)
        if isinstance(body, LazyBody):
            chunked = body.size is None
            for piece in body.pieces():
                if piece:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                    await writer.drain()
            if chunked:
                writer.write(b"0\r\n\r\n")
        else:
            writer.write(body)
        await writer.drain()
        return True
    except OSError:  # ConnectionResetError, BrokenPipeError
        return False


async def _read_answer(reader: asyncio.StreamReader) -> tuple[Outcome, int | None, bytes, str]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            return (
                Outcome.NOT_HTTP,
                None,
                b"",
                f"the answer ended inside its head: {exc.partial[:60]!r}",
            )
        return Outcome.CLOSED, None, b"", ""
    except asyncio.LimitOverrunError:
        return Outcome.NOT_HTTP, None, b"", "an answer head over 1 MiB"
    except OSError:
        return Outcome.CLOSED, None, b"", ""
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/") or not code.isdigit():
        return Outcome.NOT_HTTP, None, b"", f"status line {status_line[:60]!r}"
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    try:
        body = await _read_body(reader, headers)
    except (asyncio.IncompleteReadError, OSError, ValueError):
        body = b""  # the body was cut short; the status alone is the answer
    return Outcome.ANSWERED, int(code), body, ""


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts, total = [], 0
        while total < _BODY_LIMIT_BYTES:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                break
            parts.append(await reader.readexactly(size))
            total += size
            await reader.readexactly(2)
        return b"".join(parts)
    if "content-length" in headers:
        length = min(int(headers["content-length"]), _BODY_LIMIT_BYTES)
        return await reader.readexactly(length)
    return await reader.read(_BODY_LIMIT_BYTES)
