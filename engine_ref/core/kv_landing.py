"""Blocks reserved for a KV handoff still on its way: the decode side writes each block into
its slot as soon as it has arrived and passed its checksum, so the install at the end has
little left to copy (`kv_handoff.install(..., landing=)`).

On the engine thread, between steps: `reserve` takes the blocks a handoff of that layout needs
(its header says how many) out of the free list, held by no sequence, so no step reads them
and no allocation hands them out; it returns None when the handoff's layout is not this
engine's (another block size, KV dtype or model shape: the install converts, or refuses, at
the end) or the blocks are not free (the install then waits for them, bounded, as before).
On any thread, while steps run: `Landing.write` copies verified blocks into their reserved
slots: memory no step touches. The request enters the
scheduler only in `install`, after every block has passed and been written; until then a
failed transfer gives the blocks back with `release` (engine thread; idempotent), and nothing
of it was ever visible to a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_ref.core import kv_layout

__all__ = ["Landing", "reserve"]


@dataclass
class Landing:
    """`blocks` reserved on an engine for a handoff (one per block of its KV); the first
    `written` of them hold their verified KV."""

    blocks: list[int]
    pools: list = field(repr=False)
    written: int = 0
    released: bool = False

    def write(self, first: int, blocks: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Copy the handoff's blocks `first`, `first + 1`, ... (kv, scales: as a `KVBlock`
        holds them) into their slots; blocks land in order, each once."""
        if self.released or first != self.written:
            raise ValueError(f"Blocks land in order: expected block {self.written}, got {first}.")
        kv_layout.write_blocks(self.pools, self.blocks[first : first + len(blocks)], blocks)
        self.written = first + len(blocks)

    def release(self, block_manager) -> None:
        """Give the blocks back (engine thread); a landing installed or released is ignored."""
        if not self.released:
            self.released = True
            for block in reversed(self.blocks):
                block_manager._decref(block)


def reserve(
    engine,
    *,
    block_size: int,
    kv_dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
) -> Landing | None:
    """Reserve the blocks for a handoff with these header fields (engine thread, between
    steps); None when its layout is not this engine's or the blocks are not free (module
    doc). Only the layout is checked: the install checks the rest (the model fingerprint, the
    tokens) and gives the landing back when it refuses."""
    mc, runner = engine.model_config, engine.model_runner
    ours = (mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, engine.config.block_size)
    theirs = (num_layers, num_kv_heads, head_dim, block_size)
    if theirs != ours or kv_dtype != runner.kv_format.name or num_tokens <= 0:
        return None
    bm = engine.block_manager
    needed = -(-num_tokens // block_size)
    if needed > bm.num_free_blocks:
        return None
    # Ascending, so they form runs (`kv_layout.slot_runs`: a copy a run for every layer): the
    # free list hands out cached blocks last-freed first, in descending runs once the prefix
    # cache fills, and a landing in those took 1.4 ms per 16 SmolLM2 blocks instead of 0.4.
    blocks = sorted(bm._allocate() for _ in range(needed))
    return Landing(blocks, list(runner.kv_caches))
