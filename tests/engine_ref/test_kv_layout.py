"""`engine_ref.core.kv_layout`'s copies between KV pools and per-block tensors: a gather into a
reused buffer equals a fresh gather, bit for bit, and its blocks are views of that buffer; and
`write_blocks` writes the same pools whether its blocks lie evenly spaced in one buffer (the
indexed-copy path a received handoff takes) or each in its own tensor (block by block), at
token counts just below, at and above a block boundary, for every KV storage."""

from __future__ import annotations

import pytest
import torch

from engine_ref.core import kv_layout
from engine_ref.core.kv_dtype import KVFormat, QuantizedKVPool, allocate_pool, allocate_pools

LAYERS, HEADS, NUM_BLOCKS, BS, HD = 3, 4, 12, 4, 8
STORAGES = [torch.float32, torch.bfloat16, torch.int8]


def _random_pools(storage: torch.dtype, seed: int = 0, stacked: bool = False) -> list:
    """Random pools, each its own allocation, or (`stacked`) views of one as the engine's are."""
    gen = torch.Generator().manual_seed(seed)
    fmt, shape, cpu = KVFormat(storage), (HEADS, NUM_BLOCKS, BS, HD), torch.device("cpu")
    pools = (
        allocate_pools(fmt, shape, cpu, LAYERS) if stacked
        else [allocate_pool(fmt, shape, cpu) for _ in range(LAYERS)]
    )  # fmt: skip
    for pool in pools:
        if isinstance(pool, QuantizedKVPool):
            pool.values.copy_(torch.randint(-127, 128, pool.values.shape, generator=gen))
            pool.scales.copy_(torch.rand(pool.scales.shape, generator=gen) + 0.5)
        else:
            pool.copy_(torch.randn(pool.shape, generator=gen))
    return pools


def _same(a, b) -> bool:
    if isinstance(a, QuantizedKVPool):
        return torch.equal(a.values, b.values) and torch.equal(a.scales, b.scales)
    return torch.equal(a, b)


TOKENS = [BS - 1, BS, BS + 1, 3 * BS, 3 * BS + 1]  # below, at and above a block boundary
TABLE = [7, 2, 9, 0]
# Block tables by the copies they take (`slot_runs`): scattered slots an indexed copy, runs of
# consecutive slots one strided copy each (a run of all, two runs, runs at the 1-in-4 limit).
TABLES = {
    "scattered": [7, 2, 9, 0, 5, 11, 1, 3, 6],
    "one run": [3, 4, 5, 6, 7, 8, 9, 10, 11],
    "two runs": [8, 9, 10, 11, 0, 1, 2, 3, 4],
    "three runs": [0, 1, 2, 5, 6, 7, 9, 10, 11, 4, 3, 8],  # 12 slots in 6 runs: too scattered
}


def _reference_gather(pools, num_tokens: int, table: list[int]) -> list:
    """The blocks `gather` returns, cut out of the pools one block and layer at a time."""
    blocks = []
    for j, slot in enumerate(table[: -(-num_tokens // BS)]):
        count = min(BS, num_tokens - j * BS)
        values = [p.values if isinstance(p, QuantizedKVPool) else p for p in pools]
        kv = torch.stack([kv_layout.raw(v)[:, slot, :count] for v in values])
        scales = None
        if isinstance(pools[0], QuantizedKVPool):
            scales = torch.stack([p.scales[:, slot, :count] for p in pools])
        blocks.append((kv, scales))
    return blocks


def test_slot_runs_by_hand():
    assert kv_layout.slot_runs([3, 4, 5, 6]) == [(0, 3, 4)]
    assert kv_layout.slot_runs([8, 9, 10, 11, 0, 1, 2, 3]) == [(0, 8, 4), (4, 0, 4)]
    assert kv_layout.slot_runs([5]) is None  # 1 run for 1 slot: 4 * 1 > 1
    assert kv_layout.slot_runs([]) == []
    assert kv_layout.slot_runs([4, 3, 2, 1]) is None  # descending: four runs of one
    assert kv_layout.slot_runs([0, 1, 2, 5, 6, 7, 9, 10]) is None  # 3 runs for 8: just over
    assert kv_layout.slot_runs([0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 14]) == [
        (0, 0, 6), (6, 9, 6),  # 2 runs for 12: under the limit
    ]  # fmt: skip
    assert kv_layout.slot_runs(TABLES["three runs"]) is None


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("num_tokens", [BS - 1, BS, BS + 1, 4 * BS + 1, 8 * BS - 1, 8 * BS])
@pytest.mark.parametrize("table", list(TABLES))
def test_gather_equals_a_block_by_block_copy(storage, num_tokens, table):
    pools, fmt = _random_pools(storage, seed=3), KVFormat(storage)
    slots = TABLES[table]
    got = kv_layout.gather(pools, fmt, slots, num_tokens, BS)
    expected = _reference_gather(pools, num_tokens, slots)
    assert len(got) == len(expected)
    for (kv, scales), (ref_kv, ref_scales) in zip(got, expected, strict=True):
        assert kv.dtype == storage and torch.equal(kv_layout.raw(kv), ref_kv)
        assert (scales is None) == (ref_scales is None)
        assert scales is None or torch.equal(scales, ref_scales)


@pytest.mark.parametrize("stacked", [False, True], ids=["own allocations", "one allocation"])
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("table", list(TABLES))
def test_write_blocks_lands_each_block_in_its_slot(storage, table, stacked):
    """Received blocks (one buffer) written to every kind of table, read back block by block,
    into pools of their own and into the engine's pools (one allocation: a copy per run for
    every layer at once); blocks outside the table keep what they held."""
    source, fmt = _random_pools(storage, seed=4), KVFormat(storage)
    num_tokens = 9 * BS - 3  # 8 full blocks (their runs as in the table's name), a partial one
    blocks = kv_layout.gather(source, fmt, TABLES["one run"], num_tokens, BS)
    slots = TABLES[table]
    pools = _random_pools(storage, seed=5, stacked=stacked)
    before = _random_pools(storage, seed=5)
    kv_layout.write_blocks(pools, slots, blocks)
    for (kv, scales), (got, got_scales) in zip(
        blocks, _reference_gather(pools, num_tokens, slots), strict=True
    ):
        assert torch.equal(kv_layout.raw(kv), got)
        assert scales is None or torch.equal(scales, got_scales)
    others = [i for i in range(NUM_BLOCKS) if i not in slots[: len(blocks)]]
    for x, y in zip(pools, before, strict=True):
        xv, yv = (x.values, y.values) if isinstance(x, QuantizedKVPool) else (x, y)
        assert torch.equal(xv[:, others], yv[:, others])


@pytest.mark.parametrize("storage", STORAGES)
def test_only_pools_laid_out_in_one_allocation_are_written_as_one(storage):
    stacked = kv_layout._stacked(_random_pools(storage, stacked=True))
    assert (stacked is None) == KVFormat(storage).scaled  # int8 pools carry scales: per layer
    assert kv_layout._stacked(_random_pools(storage)) is None  # own allocations
    if stacked is not None:
        pools = _random_pools(storage, stacked=True)
        view = kv_layout._stacked(pools)
        assert view.shape == (LAYERS, HEADS, NUM_BLOCKS, BS, HD)
        assert all(torch.equal(view[i], kv_layout.raw(p)) for i, p in enumerate(pools))
        assert kv_layout._stacked(pools[::-1]) is None  # out of order
        assert kv_layout._stacked(pools[1:]) is not None and kv_layout._stacked(pools[::2]) is None


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_a_gather_into_a_used_buffer_equals_a_fresh_one(storage, num_tokens):
    pools, fmt = _random_pools(storage), KVFormat(storage)
    fresh = kv_layout.gather(pools, fmt, TABLE, num_tokens, BS)
    given: list[torch.Tensor] = []

    def allocate(nbytes: int) -> torch.Tensor:  # a used buffer: every byte already written
        given.append(torch.full((nbytes,), 0xA5, dtype=torch.uint8))
        return given[-1]

    reused = kv_layout.gather(pools, fmt, TABLE, num_tokens, BS, allocate)
    (out,) = given
    assert len(fresh) == len(reused) == -(-num_tokens // BS)
    assert sum(b.shape[2] for b, _ in reused) == num_tokens
    lo, hi = out.data_ptr(), out.data_ptr() + out.numel()
    for (kv, scales), (kv2, scales2) in zip(fresh, reused, strict=True):
        assert kv2.dtype == storage and torch.equal(kv, kv2)
        assert (scales is None) == (scales2 is None) == (not fmt.scaled)
        assert scales is None or torch.equal(scales, scales2)
        if kv2.shape[2] == BS:  # full blocks: views of `out`, no copy of their own
            assert lo <= kv2.data_ptr() < hi


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_write_blocks_from_one_buffer_equals_block_by_block(storage, num_tokens):
    source, fmt = _random_pools(storage, seed=1), KVFormat(storage)
    # Blocks evenly spaced in one buffer, as a received handoff's are, and the same blocks
    # each in a tensor of its own.
    shared = kv_layout.gather(source, fmt, TABLE, num_tokens, BS)  # one buffer for all
    separate = [(kv.clone(), None if s is None else s.clone()) for kv, s in shared]
    run = kv_layout._evenly_spaced(shared)
    full = num_tokens // BS
    assert (run is None) == (fmt.scaled or full < 2)  # the fast path is taken where it applies
    assert kv_layout._evenly_spaced(separate) is None
    target = [5, 11, 1, 3]
    a, b = _random_pools(storage, seed=2), _random_pools(storage, seed=2)
    kv_layout.write_blocks(a, target, shared)
    kv_layout.write_blocks(b, target, separate)
    assert all(_same(x, y) for x, y in zip(a, b, strict=True))
    # ... and both hold the source's tokens in the target blocks, untouched elsewhere.
    back = kv_layout.gather(a, fmt, target, num_tokens, BS)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(back, shared, strict=True))
    untouched = _random_pools(storage, seed=2)
    others = [i for i in range(NUM_BLOCKS) if i not in target[: len(shared)]]
    for x, y in zip(a, untouched, strict=True):
        xv, yv = (x.values, y.values) if isinstance(x, QuantizedKVPool) else (x, y)
        assert torch.equal(xv[:, others], yv[:, others])


def test_blocks_out_of_step_are_not_taken_as_one_run():
    pools, fmt = _random_pools(torch.float32), KVFormat(torch.float32)
    blocks = kv_layout.gather(pools, fmt, TABLE, 3 * BS, BS)
    assert kv_layout._evenly_spaced(blocks) is not None
    assert kv_layout._evenly_spaced([blocks[1], blocks[0]]) is None  # a step backwards
    skipping = kv_layout._evenly_spaced([blocks[0], blocks[2]])  # every other block: one run
    assert skipping is not None and torch.equal(skipping[1], blocks[2][0])
    assert kv_layout._evenly_spaced([blocks[0], blocks[0]]) is None  # the same block twice
    run = kv_layout._evenly_spaced([blocks[0], blocks[1], blocks[0]])  # stops where it breaks
    assert run is not None and run.shape[0] == 2
