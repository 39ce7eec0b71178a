"""The engine loop's admission of a request group, driven by hand (no engine thread): all or
none, and nothing left running whenever the caller is cancelled."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine

from engine_ref.serving.engine_loop import (
    EngineDriver,
    EngineLoop,
    EngineRequest,
    StepBatch,
    _Admit,
)
from engine_ref.serving.interface import QueueFullError, SamplingParams

STATS = SimpleNamespace(num_steps=0)


class _ManualLoop(EngineLoop):
    """An engine loop whose commands are only recorded; the test plays the engine's part."""

    def __init__(self) -> None:
        super().__init__()
        self.commands: list = []

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def _submit(self, commands: list) -> None:
        self.commands += commands

    def report(self, group_id: str, exc: BaseException | None) -> None:
        self._on_batch(StepBatch({group_id: exc}, [], (), None, STATS))

    @property
    def aborted(self) -> list[str]:
        return [c for c in self.commands if isinstance(c, str)]


def _requests(*ids: str) -> list[EngineRequest]:
    return [EngineRequest(rid, (5, 6), SamplingParams(max_tokens=3)) for rid in ids]


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_caller_cancelled_around_admission_leaves_nothing_running(when):
    async def scenario() -> list[str]:
        loop = _ManualLoop()
        await loop.start()
        task = asyncio.ensure_future(loop.admit("g", _requests("a", "b"), asyncio.Queue()))
        await asyncio.sleep(0)  # the caller now waits for the engine's answer
        if when == "before":  # cancelled while waiting; the engine admits the group later
            task.cancel()
            await asyncio.sleep(0)
            loop.report("g", None)
        else:  # admitted, and cancelled before the caller resumed
            loop.report("g", None)
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return loop.aborted

    assert sorted(asyncio.run(scenario())) == ["a", "b"]


def test_a_refused_group_raises_what_refused_it_and_aborts_nothing():
    async def scenario() -> list[str]:
        loop = _ManualLoop()
        await loop.start()
        task = asyncio.ensure_future(loop.admit("g", _requests("a", "b"), asyncio.Queue()))
        await asyncio.sleep(0)
        loop.report("g", QueueFullError("full"))
        with pytest.raises(QueueFullError):
            await task
        return loop.aborted

    assert asyncio.run(scenario()) == []


def test_the_driver_admits_a_group_all_or_none():
    engine = FakeEngine(max_waiting=2)
    driver = EngineDriver(engine)
    batch = driver.run_iteration([_Admit("g", tuple(_requests("a", "b", "c")))])
    assert isinstance(batch.add_results["g"], QueueFullError)
    assert not engine.has_unfinished() and sorted(engine.aborted) == ["a", "b"]
    batch = driver.run_iteration([_Admit("h", tuple(_requests("d", "e")))])
    assert batch.add_results["h"] is None and driver.live_ids == {"d", "e"}
