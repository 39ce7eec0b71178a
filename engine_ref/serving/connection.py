"""One HTTP connection of the server: aiohttp's request handler plus what it lacks, a deadline
for a request's head, and OpenAI error bodies for the errors aiohttp answers itself.

aiohttp has no header-read timeout: its keep-alive timer (default about an hour) is the only
bound on a client that opens a connection and sends half a request line (slowloris). Here a
connection must deliver a complete head within `header_timeout_s` of opening, or of the first
byte of a later request; otherwise it is closed. Idle keep-alive connections between requests
stay governed by aiohttp's keep-alive timeout.

aiohttp answers malformed requests (a bad request line, too many or too large headers) before
any middleware runs, in plain text; `handle_error` gives those answers a JSON error body.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Any

from aiohttp import web

from engine_ref.serving.errors import error_body
from engine_ref.serving.middlewares import json_response

LOG = logging.getLogger("engine_ref.serving.connection")


class GuardedConnection(web.RequestHandler):
    """aiohttp's `RequestHandler` with a head deadline and JSON error answers."""

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        header_timeout_s: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._event_loop = loop
        self._header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._heads_parsed = 0  # request heads the parser produced so far
        self._responses_sent = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        awaiting_head = self._heads_parsed == self._responses_sent
        if awaiting_head and data and self._head_timer is None:
            self._arm_head_timer()  # the first byte of a later request
        super().data_received(data)
        # aiohttp counts a request once its head is parsed (or found malformed).
        if self._request_count != self._heads_parsed:
            self._heads_parsed = self._request_count
            self._disarm_head_timer()

    async def finish_response(self, request: Any, resp: Any, start_time: Any) -> Any:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._responses_sent += 1

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's own error answer (400 for a malformed request, 500 for a handler that
        raised past the middlewares), as an OpenAI error body; the connection then closes."""
        if request.writer.output_size > 0:  # as aiohttp: the answer is already under way
            raise ConnectionError("Response is sent already, cannot send an error answer")
        if status >= 500:
            LOG.error("error handling a request from %s", request.remote, exc_info=exc)
        else:
            LOG.debug("malformed request from %s: %s", request.remote, message or exc)
        text = (message or HTTPStatus(status).phrase).strip().rstrip(".")
        kind = "invalid_request_error" if status < 500 else "server_error"
        response = json_response(error_body(f"{text}.", type=kind), status=status)
        response.force_close()
        return response

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self._event_loop.call_later(self._header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        LOG.debug(
            "closing a connection from %s: no complete request head within %.1f s",
            self.peername,
            self._header_timeout_s,
        )
        self.force_close()


async def listen(
    server: web.Server, host: str, port: int, *, header_timeout_s: float
) -> asyncio.AbstractServer:
    """Accept connections on `host`:`port` for `server` (an `AppRunner`'s, after `setup()`),
    each handled by a `GuardedConnection`; raises OSError when the address cannot be bound."""
    loop = asyncio.get_running_loop()

    def connection() -> GuardedConnection:
        return GuardedConnection(
            server, loop=loop, header_timeout_s=header_timeout_s, access_log=None
        )

    return await loop.create_server(connection, host, port, reuse_address=True)
