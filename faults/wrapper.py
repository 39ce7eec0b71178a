"""The lifecycle every fault wrapper shares: a transport that wraps another owns it."""

from __future__ import annotations

from typing import Self

from harness.http.transport import BaseTransport, Transport


class TransportWrapper(BaseTransport):
    """A transport that sends through `inner` and owns it, as an httpx transport wrapper does:
    entering the wrapper enters `inner`, and closing the wrapper (leaving its `with` block, or
    `aclose`) closes `inner` once; a second close does nothing until it is entered again.
    Subclasses implement `handle_request`."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self._closed = False

    async def __aenter__(self) -> Self:
        await self.inner.__aenter__()
        self._closed = False
        return self

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.inner.aclose()
