"""The transport seam: how the load generator sends one request.

The load generator knows only `Transport.handle_request`; the aiohttp client
(`harness.http.client.AiohttpTransport`) is the default implementation, tests drive the load
generator in-process with a fake one, and fault injectors wrap one transport in another.
A transport also owns what it holds open (a connection pool, a proxy): whoever uses one enters
it as an async context manager (or calls `aclose`), as httpx's transports are used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

if TYPE_CHECKING:  # the client module builds on `BaseTransport`, so only for annotations
    from harness.http.client import RawResult, RequestPayload


@runtime_checkable
class Transport(Protocol):
    """Sends one request and records its raw timeline in `result`.

    Contract (what the load generator relies on): `result.t_sent_ns` is set just before the
    request goes out and `result.t_done_ns` when it ended, both `time.perf_counter_ns()`
    values; a failure is recorded in `result` (status, error class, message), never raised;
    only cancellation propagates, after `result` says `cancelled`.

    Lifecycle: `async with transport:` opens what it needs and closes it on every exit path;
    `aclose()` closes it (idempotent). Requests are sent only while it is open.
    """

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc_info) -> None: ...

    async def aclose(self) -> None: ...


class BaseTransport:
    """The lifecycle every transport shares, for subclasses to inherit: entering returns the
    transport, leaving calls `aclose`, and `aclose` holds nothing open (override it, and
    `__aenter__` for what must be opened first)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close what the transport holds; a second call does nothing."""
