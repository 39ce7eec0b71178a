"""A decode worker's landings (`core.kv_landing`): blocks reserved on its engine as soon as a
handoff's header has arrived, written as the handoff's blocks pass their checksums, adopted by
the install (`kv_handoff.install(..., landing=)`) or given back when the transfer fails.

Without them the install copied all 47 MB of a 2,048-token SmolLM2 handoff after the last byte
had arrived (6-9 ms of the transfer on one core); with them it copies the last batch
(`kv_tcp.LAND_BATCH` blocks at most) while the receiver waited for the sender anyway.
"""

from __future__ import annotations

import asyncio

from engine_ref.serving.engine_loop import EngineLoop, EngineLoopError
from engine_ref.serving.interface import Landing, reserve_landing

__all__ = ["EngineLanding", "reserve"]

_HEADER_FIELDS = ("block_size", "kv_dtype", "num_layers", "num_kv_heads", "head_dim")


class EngineLanding:
    """A `Landing` reserved on the engine behind `engine_loop`, as `KVReceiver` uses one:
    `write` copies blocks in (any thread), `release` gives the blocks back on the engine
    thread (a no-op once an install took them, or after an earlier release)."""

    def __init__(self, engine_loop: EngineLoop, landing: Landing) -> None:
        self.engine_loop, self.landing = engine_loop, landing

    @property
    def written(self) -> int:
        return self.landing.written

    def write(self, first: int, blocks: list) -> None:
        self.landing.write(first, blocks)

    def release(self) -> None:
        landing = self.landing
        self.engine_loop.call(lambda engine: landing.release(engine.block_manager))


async def reserve(engine_loop: EngineLoop, header: dict) -> EngineLanding | None:
    """Reserve the blocks the handoff `header` (`HandoffDecoder.header`) describes; None when
    its layout is not the engine's or the blocks are not free (the install then writes every
    block, waiting for free blocks as it does)."""
    fields = {name: header[name] for name in _HEADER_FIELDS}
    num_tokens = header["num_computed_tokens"]
    future = engine_loop.call(
        lambda engine: reserve_landing(engine, **fields, num_tokens=num_tokens)
    )
    try:
        landing = await asyncio.shield(future)
    except asyncio.CancelledError:  # the reservation still happens: give it back then
        future.add_done_callback(lambda done: _release_when_reserved(engine_loop, done))
        raise
    except EngineLoopError:  # the engine is gone: the install reports it
        return None
    return None if landing is None else EngineLanding(engine_loop, landing)


def _release_when_reserved(engine_loop: EngineLoop, done: asyncio.Future) -> None:
    if not done.cancelled() and done.exception() is None and done.result() is not None:
        EngineLanding(engine_loop, done.result()).release()
