"""The mock server's token pacing, shared by its OpenAI streams (`mock_server`) and its typed
event streams (`mock_events`): when each token is due, and the fault that strikes mid-way."""

from __future__ import annotations

import asyncio


class TokenPace:
    """One streamed answer's token schedule: token i is due at `start + ttft_s` plus i gaps of
    `itl_ms` (each drawn with the jitter as it is due: O(1) memory), and the request's `fault`
    (None: none) strikes at token `break_at`. After a reset or an early end the stream is over:
    `tokens` stops and `cut` is True, so the caller writes no closing events."""

    def __init__(self, engine, request, response, start, ttft_s, fault, break_at) -> None:
        self.engine, self.request, self.response = engine, request, response
        self.start, self.ttft_s, self.fault, self.break_at = start, ttft_s, fault, break_at
        self.cut = False

    async def tokens(self, n_out: int, *, bad_json: bytes):
        """Yield each token's index when it is due; `bad_json` is the malformed-JSON event."""
        cfg, loop = self.engine.config, asyncio.get_running_loop()
        offset = self.ttft_s
        for i in range(n_out):
            if i:
                offset += cfg.itl_ms / 1e3 * self.engine._jitter()
            delay = self.start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if i == self.break_at and self.fault is not None:
                if self.fault == "reset":
                    self.request.transport.abort()
                    self.cut = True
                    return
                if self.fault == "incomplete":
                    await self.response.write_eof()
                    self.cut = True
                    return
                if self.fault == "malformed_sse":
                    await self.response.write(b"this line is not server-sent events\n\n")
                if self.fault == "malformed_json":
                    await self.response.write(bad_json)
                if self.fault == "stall":
                    await asyncio.sleep(cfg.stall_s)
                    self.start += cfg.stall_s
            yield i
