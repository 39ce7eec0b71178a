"""A decode worker's side of P/D in one process, no HTTP: `EngineLoop.call` runs on the engine
thread between steps, a handoff is installed there and parked until a caller attaches (its
outputs kept meanwhile), a handoff that does not fit waits for blocks and is then refused with
`NoFreeBlocks`, and an installed request nobody attaches to is freed. Also `bench serve`'s
refusals of a P/D layout it cannot start."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import threading

import pytest
from click.testing import CliRunner
from pd_util import GREEDY, make, prefill, prompt_of, run_single

from engine_ref.cluster import kv_tcp, pd_landing
from engine_ref.cluster.kv_link import KVTransferRejected
from engine_ref.cluster.kv_tcp import KVReceiver, send_handoff
from engine_ref.cluster.pd_worker import HandoffEngine, PDWorker, params_to_json
from engine_ref.core.kv_handoff import HandoffExporter, KVHandoffError, NoFreeBlocks
from engine_ref.serving import engine_thread
from engine_ref.serving.engine_thread import ThreadEngineLoop
from engine_ref.serving.errors import ApiError
from engine_ref.serving.server import ServerConfig
from harness.cli import bench

PARAMS = GREEDY  # max_tokens 6, greedy, logprobs 5


class Collect:
    """An output sink: every output's tokens, and an event once one finished."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finished = asyncio.Event()

    def put_nowait(self, item) -> None:
        assert not isinstance(item, BaseException), item
        self.tokens += item.outputs[0].new_token_ids
        if item.finished:
            self.finished.set()


def _extra(transfer_id: str) -> dict:
    return {"transfer_id": transfer_id, "params": params_to_json(PARAMS), "priority": 0}


async def _with_decode_worker(tiny_model, body, *, num_blocks=32, **timeouts):
    engine = make(tiny_model, num_blocks=num_blocks)
    loop = ThreadEngineLoop(engine)
    await loop.start()
    worker = PDWorker("decode", "decode-0", loop, ServerConfig(), **timeouts)
    try:
        return await body(worker, engine)
    finally:
        await loop.close()


def _handoff(tiny_model, length: int = 20):
    exporter = HandoffExporter(make(tiny_model))
    generation, handoff = prefill(exporter, "p", prompt_of(length), PARAMS)
    exporter.release("p")
    return generation, handoff


def test_a_call_runs_on_the_engine_thread_and_raises_what_fn_raised(tiny_model):
    async def body(worker, engine):
        name = await worker.engine_loop.call(lambda e: threading.current_thread().name)
        assert name == "engine-loop"
        with pytest.raises(KVHandoffError, match="boom"):
            await worker.engine_loop.call(lambda e: (_ for _ in ()).throw(KVHandoffError("boom")))

    asyncio.run(_with_decode_worker(tiny_model, body))


def test_a_call_is_answered_before_the_step_after_it(tiny_model):
    """An install's caller (the KV sender waits on it) must not wait for the decode step the
    install just added: with every step slowed by 1 s, the call's answer arrives while that
    step runs, so the loop's stats still show the steps counted inside the call. Negative
    control: with `EngineDriver.on_called` unset, the answer rides on the step's batch and the
    stats show one step more."""
    _, handoff = _handoff(tiny_model)

    async def body(worker, engine):
        worker.engine_loop.set_step_delay(1.0)
        await worker.on_handoff(handoff, _extra("t1"))  # a running request: 1 s steps follow
        steps_in_call = await worker.engine_loop.call(lambda e: e.stats().num_steps)
        assert engine.has_unfinished()
        assert worker.engine_loop.latest_stats.num_steps == steps_in_call
        worker.engine_loop.set_step_delay(0.0)

    asyncio.run(_with_decode_worker(tiny_model, body))


def test_the_step_after_a_call_waits_until_the_loop_took_the_answer(tiny_model, monkeypatch):
    """On a worker pinned to one core, the step after an install kept the core and its caller
    (the reply to the KV sender) saw the answer 2-4 ms later. So the engine thread first waits
    until the loop has resumed the task the answer woke: with requests running, every step
    after a call starts only once its caller has gone on (the wait raised from its 5 ms here, so
    a loaded machine cannot time it out). Negative control, by hand (a race, so not in CI):
    with ANSWER_WAIT_S = 0, 6 of 6 steps started first on a quiet machine."""
    monkeypatch.setattr(engine_thread, "ANSWER_WAIT_S", 2.0)
    engine = make(tiny_model)
    state = {"pending": False, "resumed": False}
    seen: list[bool] = []
    step = engine.step

    def observed_step():
        if state["pending"]:  # the first step after a call
            seen.append(state["resumed"])
            state["pending"] = False
        return step()

    monkeypatch.setattr(engine, "step", observed_step)

    def mark(_engine) -> None:
        state["pending"], state["resumed"] = True, False

    async def body() -> None:
        loop = ThreadEngineLoop(engine)
        await loop.start()
        try:
            await loop.call(
                lambda e: e.add_request(
                    "r", prompt_of(20), dataclasses.replace(GREEDY, max_tokens=200)
                )
            )
            for _ in range(6):
                await loop.call(mark)
                state["resumed"] = True
                await asyncio.sleep(0.01)  # steps run meanwhile
        finally:
            await loop.close()

    asyncio.run(body())
    assert seen == [True] * 6


def test_an_installed_handoff_decodes_and_its_outputs_wait_for_the_attaching_caller(tiny_model):
    first, handoff = _handoff(tiny_model)
    expected = run_single(make(tiny_model), prompt_of(20), PARAMS).tokens

    async def body(worker, engine):
        await worker.on_handoff(handoff, _extra("t1"))
        parked = await worker.attach("t1")
        sink = Collect()
        await asyncio.sleep(0.05)  # it decodes meanwhile: the outputs wait in the parked sink
        parked.sink.forward_to(sink)
        await asyncio.wait_for(sink.finished.wait(), 10)
        assert first.tokens + sink.tokens == expected
        with pytest.raises(ApiError, match="already attached|No KV handoff"):
            await worker.attach("t1")
        await asyncio.sleep(0.05)
        assert engine.stats().num_blocks_used == 0

    asyncio.run(_with_decode_worker(tiny_model, body, park_timeout_s=0.2))


def test_a_handoff_that_does_not_fit_waits_then_is_refused(tiny_model):
    _, handoff = _handoff(tiny_model, length=40)  # 3 blocks of 16
    slow = {**_extra("t-a"), "params": {**params_to_json(PARAMS), "max_tokens": 20}}

    async def body(worker, engine):
        worker.engine_loop.set_step_delay(0.05)  # the first runs 20 steps of 50 ms
        await worker.on_handoff(handoff, slow)  # 3 of the 4 blocks
        with pytest.raises(NoFreeBlocks, match="needs 3 free KV blocks and this engine has 1"):
            await worker.on_handoff(handoff, _extra("t-b"))
        assert list(worker.parked) == ["t-a"]
        worker.install_wait_s = 10.0  # long enough for t-a to end and free its blocks
        await worker.on_handoff(handoff, _extra("t-c"))
        worker.engine_loop.set_step_delay(0)
        for transfer_id in ("t-a", "t-c"):
            sink = Collect()
            (await worker.attach(transfer_id)).sink.forward_to(sink)
            await asyncio.wait_for(sink.finished.wait(), 10)
        await asyncio.sleep(0.05)
        assert engine.stats().num_blocks_used == 0

    asyncio.run(_with_decode_worker(tiny_model, body, num_blocks=4, install_wait_s=0.2))


def test_an_installed_request_nobody_attaches_to_is_freed(tiny_model):
    _, handoff = _handoff(tiny_model)
    slow = {**_extra("t3"), "params": {**params_to_json(PARAMS), "max_tokens": 10_000 - 21}}

    async def body(worker, engine):
        worker.engine_loop.set_step_delay(0.02)  # far from its max_tokens at the timeout
        await worker.on_handoff(handoff, slow)
        kept = worker.parked["t3"].sink  # decoding: it holds blocks until the timeout aborts it
        await asyncio.sleep(0.4)
        assert not worker.parked and engine.stats().num_blocks_used == 0
        assert not kept.buffer[-1].finished  # it did not end by itself: the timeout freed it

    asyncio.run(_with_decode_worker(tiny_model, body, park_timeout_s=0.1))


def test_a_handoff_without_its_request_parameters_is_refused(tiny_model):
    _, handoff = _handoff(tiny_model)

    async def body(worker, engine):
        with pytest.raises(KVHandoffError, match="no transfer id"):
            await worker.on_handoff(handoff, None)
        with pytest.raises(KVHandoffError, match="parameters are unusable"):
            await worker.on_handoff(handoff, {"transfer_id": "t4", "params": {"n": "x"}})

    asyncio.run(_with_decode_worker(tiny_model, body))


def test_the_prefill_engine_hands_off_only_marked_requests(tiny_model):
    engine = HandoffEngine(make(tiny_model))
    engine.add_request("kvh-a", prompt_of(10), PARAMS)
    engine.add_request("plain", prompt_of(10), PARAMS)
    reasons = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                reasons[output.request_id] = output.outputs[0].finish_reason
    assert reasons == {"kvh-a": "handoff", "plain": "length"}
    assert engine.exporter.held == ["kvh-a"]
    engine.abort("kvh-a")
    assert engine.stats().num_blocks_used == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefill-workers", "1"], "P/D mode needs both --prefill-workers and --decode-workers."),
        (["--decode-workers", "1"], "P/D mode needs both --prefill-workers and --decode-workers."),
        (["--prefill-workers", "1", "--decode-workers", "1", "--replicas", "2"],
         "--prefill-workers/--decode-workers replace --replicas and --router."),
        (["--prefill-workers", "1", "--decode-workers", "1", "--engine-loop", "process"],
         "P/D workers run the engine in thread mode (--engine-loop thread)."),
        (["--prefill-workers", "0", "--decode-workers", "1"], "0 is not in the range x>=1."),
    ],
)  # fmt: skip
def test_bench_serve_refuses_a_pd_layout_it_cannot_start_in_one_sentence(args, message):
    result = CliRunner().invoke(bench, ["serve", "--model", "tiny-random", *args])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(("corrupt", "batch"), [(False, 2), (False, 100), (True, 2)])
def test_over_tcp_blocks_land_before_the_install_or_go_back(
    tiny_model, monkeypatch, corrupt, batch
):
    """The worker's receiver as `bench serve` wires it: blocks reserved when the header
    arrives, each written as it passes its checksum, all of them before the install, which
    adopts them; a transfer that fails gives them back and installs nothing."""
    _, handoff = _handoff(tiny_model, length=100)  # 7 blocks
    expected = run_single(make(tiny_model), prompt_of(100), PARAMS).tokens
    monkeypatch.setattr(kv_tcp, "LAND_BATCH", batch)  # 2: pairs, then one by one; 100: one by one
    landings = []
    reserve = pd_landing.reserve

    async def spy(engine_loop, header):
        landings.append(await reserve(engine_loop, header))
        return landings[-1]

    monkeypatch.setattr(pd_landing, "reserve", spy)

    def flip_block_5(frames):  # header, then a record and a payload per block
        for i, frame in enumerate(frames):
            yield (
                bytes([memoryview(frame).cast("B")[0] ^ 1]) + bytes(frame[1:]) if i == 12 else frame
            )

    async def body(worker, engine):
        receiver = KVReceiver(worker.on_handoff, with_extra=True, on_header=worker.on_header)
        async with receiver:
            send = send_handoff("127.0.0.1", receiver.port, handoff, extra=_extra("t5"),
                                transform=flip_block_5 if corrupt else None)  # fmt: skip
            if corrupt:
                with pytest.raises(KVTransferRejected, match="block 5 failed"):
                    await send
                for _ in range(200):  # the release runs on the engine thread
                    if engine.stats().num_blocks_used == 0:
                        break
                    await asyncio.sleep(0.01)
                assert engine.stats().num_blocks_used == 0 and not worker.parked
                (landing,) = landings  # reserved (when the header came), then given back
                assert landing is not None and landing.written <= 5  # verified blocks only
                return
            worker.engine_loop.set_step_delay(0.2)  # 5 tokens to decode: over a second
            await send
            (landing,) = landings
            parked = await worker.attach("t5")
            table = await worker.engine_loop.call(  # read between steps, on the engine thread
                lambda e: e.requests[parked.engine_id].sequences[0].block_table[:7]
            )
            worker.engine_loop.set_step_delay(0)
            assert landing.written == 7 and table == landing.landing.blocks
            sink = Collect()
            parked.sink.forward_to(sink)
            await asyncio.wait_for(sink.finished.wait(), 10)
            assert handoff.token_ids[100:] + tuple(sink.tokens) == tuple(expected)

    asyncio.run(_with_decode_worker(tiny_model, body))


def test_a_pinned_worker_counts_torch_threads_on_its_own_cores():
    """A worker process imports torch before it is pinned (spawn unpickles the cluster's
    modules first), and torch counted every core then: its event loop's torch work (a
    receiver's landing writes) ran an OpenMP team of two on one core, 14 ms a 2,048-token
    landing instead of 5. `pin` sets the count. Negative control, in the same child: affinity
    alone keeps the count of every core. (The child first takes every core: xdist pins this
    process.)"""
    code = (
        "import os\n"
        "os.sched_setaffinity(0, range(os.cpu_count()))\n"
        "import torch\n"
        "from engine_ref.cluster import replicas\n"
        "before = torch.get_num_threads()\n"
        "os.sched_setaffinity(0, {0})\n"
        "affinity_only = torch.get_num_threads()\n"
        "replicas.pin({0})\n"
        "print(before, affinity_only, torch.get_num_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    before, affinity_only, pinned = map(int, out)
    assert affinity_only == before  # the count of every core stays
    assert pinned == 1
