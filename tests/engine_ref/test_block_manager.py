"""Block manager: refcounts, prefix-cache keys and verification, LRU eviction, copy-on-write,
deferred frees. Hand-worked cases with block_size 4."""

from __future__ import annotations

import pytest

from engine_ref.core.block_manager import BlockManager
from engine_ref.core.detokenizer import IncrementalDetokenizer
from engine_ref.core.engine_config import SamplingParams
from engine_ref.core.sequence import Request, Sequence

BS = 4


def seq(tokens: list[int], computed: int = 0) -> Sequence:
    request = Request("r", list(tokens), SamplingParams(), 0, 0)
    s = Sequence(0, request, 0, list(tokens), len(tokens), IncrementalDetokenizer(str, []))
    s.num_computed_tokens = computed
    return s


def prefill(bm: BlockManager, s: Sequence) -> int:
    """Admit and compute the whole sequence as one step; returns tokens served from cache."""
    cached = bm.allocate_prefix(s)
    assert bm.can_append(s, s.num_uncomputed_tokens)
    bm.append_slots(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)
    return cached


def test_allocation_and_refcounts():
    bm = BlockManager(8, BS)
    a = seq(list(range(10)))
    assert bm.blocks_needed(a, 10) == 3
    prefill(bm, a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_counts[b] == 1 for b in a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_table == []


def test_prefix_hit_shares_full_blocks_and_never_the_last_token():
    bm = BlockManager(16, BS)
    a = seq(list(range(12)))  # three full blocks
    prefill(bm, a)
    b = seq(list(range(12)))  # identical prompt: last token recomputed -> 2 blocks hit
    assert prefill(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    c = seq(list(range(8)) + [99, 98, 97, 96, 95])  # diverges in the third block
    assert prefill(bm, c) == 8
    d = seq([0, 1, 2, 99] + list(range(4, 13)))  # diverges in the first block
    assert prefill(bm, d) == 0


def test_salt_separates_model_versions():
    a, b = BlockManager(8, BS, salt="model-v1"), BlockManager(8, BS, salt="model-v2")
    assert a.root_key != b.root_key
    s1, s2 = seq(list(range(9))), seq(list(range(9)))
    prefill(a, s1)
    prefill(b, s2)
    assert s1.block_hashes[0] != s2.block_hashes[0]


def test_lru_eviction_prefers_uncached_then_oldest_cached():
    bm = BlockManager(6, BS)
    a = seq(list(range(8)) + [50])  # blocks 0, 1 full (cached), block 2 partial
    prefill(bm, a)
    assert a.block_table == [0, 1, 2]
    bm.free(a)  # tail first: 2 (uncached) to the front; then 1, then 0 at the back
    assert list(bm.free_blocks) == [2, 3, 4, 5, 1, 0]
    b = seq([70] * 9)  # takes 2, 3, 4
    prefill(bm, b)
    assert b.block_table == [2, 3, 4] and bm.num_cached_blocks == 4
    c = seq([80] * 5)  # takes 5, then evicts the least recently freed cached block: 1
    prefill(bm, c)
    assert c.block_table == [5, 1] and bm.num_cached_blocks == 4  # a0, b0, b1, c0
    again = seq(list(range(8)) + [50])
    assert bm.allocate_prefix(again) == 4  # a's first block survived, its second did not
    assert again.block_table == [0]


def test_prefix_hit_on_free_block_removes_it_from_free_list():
    bm = BlockManager(4, BS)
    a = seq(list(range(5)))
    prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq(list(range(5)))
    assert bm.allocate_prefix(b) == 4
    assert bm.num_free_blocks == 3 and b.block_table[0] not in bm.free_blocks


def test_copy_on_write_of_shared_partial_block():
    bm = BlockManager(8, BS)
    parent = seq(list(range(6)))  # block 0 full, block 1 holds 2 of 4
    prefill(bm, parent)
    child = seq(list(range(6)))
    bm.fork(parent, child)
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2]
    parent.token_ids.append(7)
    child.token_ids.append(8)
    assert bm.blocks_needed(parent, 1) == 1  # the copy
    copies = bm.append_slots(parent, 1)
    assert len(copies) == 1 and copies[0][0] == child.block_table[1]
    assert parent.block_table[1] == copies[0][1] and parent.block_table[0] == child.block_table[0]
    assert bm.append_slots(child, 1) == []  # now the sole owner: writes in place
    assert [bm.ref_counts[b] for b in child.block_table] == [2, 1]


def test_frees_are_deferred_until_the_step_ends():
    bm = BlockManager(2, BS)
    a = seq(list(range(8)))
    prefill(bm, a)
    bm.begin_step()
    bm.free(a)
    assert bm.num_free_blocks == 0  # the step may still be reading these blocks
    assert not bm.can_append(seq([1]), 1)
    bm.end_step()
    assert bm.num_free_blocks == 2


def test_double_free_is_caught():
    bm = BlockManager(2, BS)
    a = seq([1, 2])
    prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    prefill(bm, seq(list(range(9))))
    assert prefill(bm, seq(list(range(9)))) == 0
    assert bm.num_cached_blocks == 0


def test_cache_salt_separates_tenants_even_when_keys_collide():
    """Every key collides (hash 0): a first block is served only to a request hashing from the
    same root key, which binds the cache salt."""
    bm = BlockManager(16, BS, hash_fn=lambda parent_key, tokens: 0)

    def salted(salt: str | None) -> Sequence:
        s = seq(list(range(9)))
        s.request.cache_salt = salt
        return s

    prefill(bm, salted("tenant-a"))
    assert prefill(bm, salted("tenant-b")) == 0
    assert prefill(bm, salted(None)) == 0
    assert prefill(bm, salted("tenant-a")) == 4  # its second block collides with the first
    assert bm.root_key_of(salted(None)) == bm.root_key != bm.root_key_of(salted("tenant-a"))
