"""`core.kv_landing` through `kv_handoff.install(..., landing=)` on tiny-random engines: blocks
reserved for a handoff and written before the install (none, some, all of them) decode to the
single engine's tokens and logprobs at lengths around the block size; while reserved, steps of
other requests never take or touch them; a landing the install refuses, or one released, gives
every block back (twice is a no-op); another layout, or too few free blocks, reserves nothing;
blocks land in order only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pd_util import GREEDY, assert_idle, make, prefill, prompt_of, run_single, run_to_end

from engine_ref.core import kv_handoff, kv_landing, kv_layout
from engine_ref.core.kv_handoff import HandoffExporter, KVHandoff, KVHandoffError


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(single, A, B): block size 16, float32 KV, 32 blocks each."""
    return make(tiny_model), make(tiny_model), make(tiny_model)


def _reserve(engine, handoff: KVHandoff):
    return kv_landing.reserve(
        engine, block_size=handoff.block_size, kv_dtype=handoff.kv_dtype,
        num_layers=handoff.num_layers, num_kv_heads=handoff.num_kv_heads,
        head_dim=handoff.head_dim, num_tokens=handoff.num_computed_tokens,
    )  # fmt: skip


def _handed_off(engine, prompt: list[int]):
    """The prompt prefilled on `engine`: its first token and its handoff (released there)."""
    exporter = HandoffExporter(engine)
    first, handoff = prefill(exporter, "r", prompt, GREEDY)
    exporter.release("r")
    return first, handoff


def _land(landing, handoff: KVHandoff, count: int) -> None:
    if count:
        landing.write(0, [(b.kv, b.scales) for b in handoff.blocks[:count]])


@pytest.mark.parametrize("length", [15, 16, 17, 100])
@pytest.mark.parametrize("landed", ["none", "some", "all"])
def test_a_landed_install_equals_the_single_engine(engines, length, landed):
    single, a, b = engines
    prompt = prompt_of(length)
    expected = run_single(single, prompt, GREEDY)
    first, handoff = _handed_off(a, prompt)
    landing = _reserve(b, handoff)
    assert kv_layout._stacked(b.model_runner.kv_caches) is not None  # a copy a run, all layers
    count = {"none": 0, "some": len(handoff.blocks) // 2, "all": len(handoff.blocks)}[landed]
    _land(landing, handoff, count)
    assert b.stats().num_blocks_used == len(handoff.blocks)  # reserved, no request yet
    assert not b.has_unfinished()
    installed = kv_handoff.install(b, "r", handoff, GREEDY, landing=landing)
    assert installed.num_blocks == len(handoff.blocks)
    assert b.requests["r"].sequences[0].block_table == landing.blocks  # adopted, not copied
    got = run_to_end(b, first)
    assert (got.tokens, got.logprobs) == (expected.tokens, expected.logprobs)
    landing.release(b.block_manager)  # after the install: a no-op
    assert_idle(single, a, b)


def test_reserved_blocks_are_never_taken_by_other_requests(tiny_model, engines):
    single, a, _ = engines
    b = make(tiny_model, num_blocks=12)
    prompt = prompt_of(100)  # 7 blocks
    expected = run_single(single, prompt, GREEDY)
    first, handoff = _handed_off(a, prompt)
    landing = _reserve(b, handoff)
    _land(landing, handoff, len(handoff.blocks))
    landed = [p.clone() for p in b.model_runner.kv_caches]
    # Another request runs to its end on the 5 blocks left while the landing waits.
    b.add_request("other", prompt_of(60, seed=9), dataclasses.replace(GREEDY, max_tokens=15))
    tables: list[list[int]] = []
    for _ in range(40):
        if not b.has_unfinished():
            break
        b.step()
        tables += [list(s.block_table) for s in b.scheduler.running]
    assert tables and not set(landing.blocks) & {x for t in tables for x in t}
    for pool, before in zip(b.model_runner.kv_caches, landed, strict=True):
        assert torch.equal(pool[:, landing.blocks], before[:, landing.blocks])  # untouched
    kv_handoff.install(b, "r", handoff, GREEDY, landing=landing)
    got = run_to_end(b, first)
    assert (got.tokens, got.logprobs) == (expected.tokens, expected.logprobs)
    assert_idle(a, b)


def test_release_and_refused_installs_give_every_block_back(engines):
    _, a, b = engines
    _, handoff = _handed_off(a, prompt_of(40))
    landing = _reserve(b, handoff)
    assert b.stats().num_blocks_used == 3
    landing.release(b.block_manager)
    landing.release(b.block_manager)  # twice: a no-op
    assert_idle(b)
    with pytest.raises(ValueError, match="Blocks land in order"):
        landing.write(0, [(handoff.blocks[0].kv, None)])  # released
    # The install refuses (nothing left to decode): the landing goes back too.
    landing = _reserve(b, handoff)
    _land(landing, handoff, 2)
    with pytest.raises(KVHandoffError, match="nothing is left to decode"):
        kv_handoff.install(
            b, "r", handoff, dataclasses.replace(GREEDY, max_tokens=1), landing=landing
        )
    assert_idle(b)
    # A second install of a live request is a no-op that gives its landing back.
    kv_handoff.install(b, "r", handoff, GREEDY)
    again = _reserve(b, handoff)
    assert kv_handoff.install(b, "r", handoff, GREEDY, landing=again).already_installed
    assert b.stats().num_blocks_used == 3
    kv_handoff.free(b, "r")
    b.step()
    assert_idle(b)


def test_blocks_land_in_order_only(engines):
    _, a, b = engines
    _, handoff = _handed_off(a, prompt_of(40))
    landing = _reserve(b, handoff)
    blocks = [(x.kv, x.scales) for x in handoff.blocks]
    with pytest.raises(ValueError, match="expected block 0, got 1"):
        landing.write(1, blocks[1:2])
    landing.write(0, blocks[:1])
    with pytest.raises(ValueError, match="expected block 1, got 0"):
        landing.write(0, blocks[:1])  # the same block twice
    landing.write(1, blocks[1:])
    assert landing.written == 3
    landing.release(b.block_manager)
    assert_idle(b)


def test_another_layout_or_too_few_blocks_reserves_nothing(tiny_model, engines):
    _, a, b = engines
    _, handoff = _handed_off(a, prompt_of(40))
    for engine in (make(tiny_model, block_size=8), make(tiny_model, kv_cache_dtype="bf16")):
        assert _reserve(engine, handoff) is None
        assert_idle(engine)
    small = make(tiny_model, num_blocks=3)
    assert _reserve(small, handoff) is not None  # 3 blocks for 3: at the limit
    assert _reserve(small, handoff) is None  # none left
    longer = dataclasses.replace(handoff, num_computed_tokens=49)  # 4 blocks: one too many
    assert _reserve(make(tiny_model, num_blocks=3), longer) is None
    assert _reserve(b, dataclasses.replace(handoff, num_computed_tokens=0)) is None
    assert_idle(b)


def test_blocks_reserved_from_the_prefix_cache_come_in_ascending_runs(tiny_model, engines):
    """The free list hands out cached blocks last freed first: once the prefix cache holds a
    request's blocks, a reservation that takes them got them in descending order, one slot
    run each, and every landing write went through a copy per layer. Reserved blocks are
    sorted, so they form runs. Negative control: unsorted, the table descends."""
    _, a, _ = engines
    b = make(tiny_model, num_blocks=8)
    run_single(b, prompt_of(100), GREEDY)  # its 7 full blocks stay cached, freed in reverse
    _, handoff = _handed_off(a, prompt_of(8 * 16 - 4, seed=1))  # needs all 8 blocks
    landing = _reserve(b, handoff)
    assert landing is not None and len(landing.blocks) == 8
    assert landing.blocks == sorted(landing.blocks) == list(range(8))
    assert kv_layout.slot_runs(landing.blocks) == [(0, 0, 8)]
    landing.release(b.block_manager)
    assert_idle(b)
