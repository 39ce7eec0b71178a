"""KV block allocation: refcounts, chained-hash prefix cache, LRU eviction, copy-on-write,
and frees deferred until the step that reads the blocks has finished.

A full block's cache key chains the parent block's key, the block's exact token ids and a salt
naming the model version: `hash_fn(parent_key, tokens)`, the first block's parent key (the root
key) being derived from the salt and the request's `cache_salt`, so requests with different
cache salts (tenants) never share a block. Keys can collide, so a hit is served only when the
cached block's tokens equal the request's and its recorded parent is the block the request just
matched (identified by block id and a generation number bumped whenever the block is reused) or,
for a first block, the root key the request hashed from. The last prompt token is never served
from the cache, so every prefill computes at least one row (its logits).

With KV eviction (`engine_ref.core.kv_eviction`) a sequence's table holds its kept blocks
only; `evict` drops blocks out of its window, and `register_full_blocks` enters nothing computed
after a sequence's first eviction (its context was lossy), so the cache only ever serves exact KV.

Free blocks wait in one `OrderedDict` in eviction order: blocks without cached content at the
front (reused first), cached blocks appended at the back as they are freed (least recently used
nearest the front). A prefix hit on a free block removes it in O(1).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

from engine_ref.core.sequence import Sequence
from engine_ref.core.stats import KVEvictionStats

HashFn = Callable[[int, tuple[int, ...]], int]


def default_hash(parent_key: int, tokens: tuple[int, ...]) -> int:
    return hash((parent_key, tokens))


def _root_key(salt: str, cache_salt: str | None) -> int:
    text = repr((salt, cache_salt))  # repr keeps the pair unambiguous whatever the strings hold
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        salt: str = "",
        hash_fn: HashFn = default_hash,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.root_key = _root_key(salt, None)
        self.hash_fn = hash_fn
        self.ref_counts = [0] * num_blocks
        self.generation = [0] * num_blocks
        # Cached content of a full block: its key, tokens, and what it extends: (parent block,
        # its generation), or for a first block the root key it was hashed from.
        self.block_key: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.block_parent: list[tuple[int, int] | int | None] = [None] * num_blocks
        self.key_to_block: dict[int, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.pending_free: list[int] = []
        self.step_in_flight = False
        self.num_evicted_tokens = 0  # KV eviction counters, since start
        self.num_requests_evicted = 0

    # -- gauges ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.key_to_block)

    def eviction_stats(self) -> KVEvictionStats:
        return KVEvictionStats(self.num_evicted_tokens, self.num_requests_evicted)

    # -- step fencing -----------------------------------------------------------------------
    def begin_step(self) -> None:
        self.step_in_flight = True

    def end_step(self) -> None:
        """The step's forward has finished reading its blocks: release deferred frees."""
        self.step_in_flight = False
        for block in self.pending_free:
            self._release(block)
        self.pending_free.clear()

    # -- allocation -----------------------------------------------------------------------------
    def allocate_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest verified prefix of a sequence that has no blocks
        yet; returns the number of tokens served from the cache (a multiple of block_size)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block, key in self.cached_prefix(seq):
            if self.ref_counts[block] == 0:
                self._unfree(block)
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(key)
        cached = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = cached
        return cached

    def cached_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        """(block, key) of each cached block serving the longest verified prefix of `seq`'s
        tokens, changing nothing (`allocate_prefix` attaches them; the `affinity` policy
        counts them)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        parent_key = self.root_key_of(seq)
        parent: tuple[int, int] | int = parent_key
        found = []
        # Never the last token: its row must be computed to produce logits.
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            key = self.hash_fn(parent_key, tokens)
            block = self.key_to_block.get(key)
            if block is None or self.block_tokens[block] != tokens:
                break
            if self.block_parent[block] != parent:
                break
            found.append((block, key))
            parent_key, parent = key, (block, self.generation[block])
        return found

    def root_key_of(self, seq: Sequence) -> int:
        """The key a sequence's first block chains from: the engine's salt and the request's
        cache salt."""
        cache_salt = seq.request.cache_salt
        return self.root_key if cache_salt is None else _root_key(self.salt, cache_salt)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks that `append_slots(seq, num_new_tokens)` would take."""
        total = seq.num_computed_tokens + num_new_tokens
        needed = max(0, -(-total // self.block_size) - self._num_logical_blocks(seq))
        return needed + int(self._needs_copy(seq))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make `seq.block_table` cover its next `num_new_tokens` positions. Returns the
        (src, dst) block copies to perform before the step writes (copy-on-write of a shared
        partial block). The caller checks `can_append` first."""
        copies = []
        if self._needs_copy(seq):
            index = self._write_index(seq)
            src = seq.block_table[index]
            dst = self._allocate()
            self._decref(src)
            seq.block_table[index] = dst
            copies.append((src, dst))
        total = seq.num_computed_tokens + num_new_tokens
        while self._num_logical_blocks(seq) * self.block_size < total:
            seq.block_table.append(self._allocate())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every block of `parent` with `child` (refcounts up, no copy)."""
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.kv_evicted_tokens = parent.kv_evicted_tokens
        for block in child.block_table:
            self.ref_counts[block] += 1

    def register_full_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's newly computed full blocks into the prefix cache; none once it
        has evicted KV (they were computed from a lossy context; those before were entered)."""
        if not self.enable_prefix_caching or seq.kv_evicted_tokens:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            block = seq.block_table[i]
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent_key = seq.block_hashes[-1] if i else self.root_key_of(seq)
            key = self.hash_fn(parent_key, tokens)
            seq.block_hashes.append(key)
            if self.block_key[block] is not None:
                continue  # already cached content (a prefix hit or a shared block)
            if i:
                parent = seq.block_table[i - 1]
                self.block_parent[block] = (parent, self.generation[parent])
            else:
                self.block_parent[block] = parent_key
            self.block_key[block] = key
            self.block_tokens[block] = tokens
            self.key_to_block.setdefault(key, block)

    def trim(self, seq: Sequence, num_positions: int) -> None:
        """Free the blocks of `seq` past those covering its first `num_positions` positions
        (a speculative step's rejected tail: never registered, as they hold no computed
        token). Deferred while a step is in flight, like every free."""
        keep = -(-num_positions // self.block_size)
        assert keep * self.block_size >= seq.num_computed_tokens
        for block in reversed(seq.block_table[keep:]):
            self._decref(block)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks reaching zero become free (deferred while a
        step is in flight). Tail blocks go first so a shared prefix stays cached longest."""
        for block in reversed(seq.block_table):
            self._decref(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = seq.kv_evicted_tokens = 0

    def evict(self, seq: Sequence, first: int, count: int) -> None:
        """Drop `count` blocks of `seq`'s table from index `first` (past its sink blocks):
        KV eviction (`core.kv_eviction`), between steps; frees are deferred while a step is in
        flight, like every free. Counts the tokens, and the request at its first eviction."""
        for block in seq.block_table[first : first + count]:
            self._decref(block)
        del seq.block_table[first : first + count]
        num_tokens = count * self.block_size
        seq.kv_evicted_tokens += num_tokens
        self.num_evicted_tokens += num_tokens
        request = seq.request
        if not request.kv_evicted_tokens:
            self.num_requests_evicted += 1
        request.kv_evicted_tokens = max(request.kv_evicted_tokens, seq.kv_evicted_tokens)

    # -- internals ------------------------------------------------------------------------------
    def _num_logical_blocks(self, seq: Sequence) -> int:
        """Blocks covering the sequence's positions so far, evicted ones included."""
        return len(seq.block_table) + seq.kv_evicted_tokens // self.block_size

    def _write_index(self, seq: Sequence) -> int:
        """Table index of the block its next token goes to (never a sink block once it has
        evicted: eviction starts past the sinks)."""
        return (seq.num_computed_tokens - seq.kv_evicted_tokens) // self.block_size

    def _needs_copy(self, seq: Sequence) -> bool:
        """True when the next write lands in a block another sequence also references."""
        index = self._write_index(seq)
        return index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] > 1

    def _allocate(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        key = self.block_key[block]
        if key is not None:  # evict its cached content
            if self.key_to_block.get(key) == block:
                del self.key_to_block[key]
            self.block_key[block] = self.block_tokens[block] = self.block_parent[block] = None
        self.generation[block] += 1
        self.ref_counts[block] = 1
        return block

    def _decref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} freed twice"
        if self.ref_counts[block] == 0:
            if self.step_in_flight:
                self.pending_free.append(block)
            else:
                self._release(block)

    def _unfree(self, block: int) -> None:
        if self.free_blocks.pop(block, False) is False:
            self.pending_free.remove(block)

    def _release(self, block: int) -> None:
        self.free_blocks[block] = None
        if self.block_key[block] is None:
            self.free_blocks.move_to_end(block, last=False)
