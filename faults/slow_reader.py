"""The aiohttp transport the client faults stand on (`FaultAiohttpTransport`: it notes each
error answer's Retry-After and can pace the reads of chosen responses) and the slow reader
built on it (`SlowReaderTransport`)."""

from __future__ import annotations

import asyncio

from faults.gates import Gate, affected
from faults.retrying import RetryAfterLog
from harness.http.client import AiohttpTransport, ClientOptions, RawResult, RequestPayload, send


class _PacedContent:
    def __init__(self, content, delay_s: float, read_bytes: int) -> None:
        self._content, self._delay_s, self._read_bytes = content, delay_s, read_bytes

    async def readany(self) -> bytes:
        await asyncio.sleep(self._delay_s)
        return await self._content.read(self._read_bytes)


class _PacedResponse:
    def __init__(self, response, pacing: tuple[float, int]) -> None:
        self._response = response
        self.status = response.status
        self.headers = response.headers
        self.content = _PacedContent(response.content, *pacing)

    async def read(self) -> bytes:
        return await self._response.read()


class _Answer:
    def __init__(self, request, on_headers, pacing: tuple[float, int] | None) -> None:
        self._request, self._on_headers, self._pacing = request, on_headers, pacing

    async def __aenter__(self):
        response = await self._request.__aenter__()
        if response.status >= 400:
            self._on_headers(response.headers)
        return response if self._pacing is None else _PacedResponse(response, self._pacing)

    async def __aexit__(self, *exc_info) -> None:
        await self._request.__aexit__(*exc_info)


class _SessionView:
    """The aiohttp session as `harness.http.client.send` uses it (`post` as an async context
    manager giving a response with `status`, `read()` and `content.readany()`), noting the
    headers of error answers and pacing the reads when `pacing` is set."""

    def __init__(self, session, on_headers, pacing: tuple[float, int] | None) -> None:
        self._session, self._on_headers, self._pacing = session, on_headers, pacing

    def post(self, url: str, *, data: bytes, headers: dict[str, str] | None = None) -> _Answer:
        extra = {"read_bufsize": self._pacing[1]} if self._pacing is not None else {}
        request = self._session.post(url, data=data, headers=headers, **extra)
        return _Answer(request, self._on_headers, self._pacing)


class FaultAiohttpTransport(AiohttpTransport):
    """`AiohttpTransport` as the fault wrappers need it: it notes each error answer's
    Retry-After in `retry_after` (the result has no headers) and lets a subclass pace the reads
    of chosen responses. Requests still go through `harness.http.client.send`, its one path."""

    def __init__(
        self,
        options: ClientOptions,
        *,
        max_connections: int,
        retry_after: RetryAfterLog | None = None,
    ) -> None:
        super().__init__(options, max_connections=max_connections)
        self.retry_after = retry_after

    def pacing(self, payload: RequestPayload) -> tuple[float, int] | None:
        """(seconds between reads, bytes per read) for a slowly read response; None: normal."""
        return None

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        pacing = self.pacing(payload)
        if self.retry_after is None and pacing is None:
            await send(self.session, self.options, payload, result)
            return
        log = self.retry_after

        def on_headers(headers) -> None:
            if log is not None:
                log.note(payload.request_id, headers.get("Retry-After"))

        await send(_SessionView(self.session, on_headers, pacing), self.options, payload, result)


class SlowReaderTransport(FaultAiohttpTransport):
    """Reads a `fraction` of the admitted streamed responses slowly: at most `read_bytes` per
    read, `read_delay_ms` before each, with aiohttp's read buffer cut to `read_bytes`, so the
    socket stops being drained and the server feels backpressure once the kernel's socket
    buffers fill (for token streams of ~100-byte events that can take many events). The
    recorded read times are when the client consumed the bytes, not when they arrived."""

    def __init__(
        self,
        options: ClientOptions,
        *,
        max_connections: int,
        fraction: float = 1.0,
        read_delay_ms: float,
        read_bytes: int = 256,
        seed: int | str = 0,
        active: Gate | None = None,
        retry_after: RetryAfterLog | None = None,
    ) -> None:
        super().__init__(options, max_connections=max_connections, retry_after=retry_after)
        if read_delay_ms <= 0 or read_bytes < 1:
            raise ValueError("read_delay_ms must be > 0 and read_bytes >= 1")
        self.fraction, self.seed, self.active = fraction, seed, active
        self.read_delay_ms, self.read_bytes = read_delay_ms, read_bytes

    def pacing(self, payload: RequestPayload) -> tuple[float, int] | None:
        if not affected(payload, self.active, self.seed, self.fraction):
            return None
        return self.read_delay_ms / 1e3, self.read_bytes
