"""The transport seam: how the load generator sends one request.

The load generator knows only `Transport.handle_request`; the aiohttp client
(`harness.client.AiohttpTransport`) is the default implementation, tests drive the load
generator in-process with a fake one, and fault injectors wrap one transport in another.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from harness.client import RawResult, RequestPayload


@runtime_checkable
class Transport(Protocol):
    """Sends one request and records its raw timeline in `result`.

    Contract (what the load generator relies on): `result.t_sent_ns` is set just before the
    request goes out and `result.t_done_ns` when it ended, both `time.perf_counter_ns()`
    values; a failure is recorded in `result` (status, error class, message), never raised;
    only cancellation propagates, after `result` says `cancelled`.
    """

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None: ...
