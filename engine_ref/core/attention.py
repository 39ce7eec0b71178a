"""Paged attention over per-layer KV block pools.

A step's tokens are one flattened batch of T rows: first the decode rows (one new token per
sequence), then the prefill chunks (one or more new tokens per sequence, possibly continuing a
cached prefix). A layer's pool is head-major, [2 * kvh, num_blocks, block_size, hd]: key heads
first, then value heads, each head's blocks contiguous. Seen as rows of one (head, block) each,
[2 * kvh * num_blocks, block_size * hd], one index_select gathers a batch's keys and values
straight into [2 * kvh, B, L, hd], where every (head, sequence) pair is a contiguous [L, hd]
matrix that a batched matmul reads as it is. The token-major layout [num_blocks, block_size,
2 * kvh, hd] this replaced needed a strided copy of K and V in every layer: 17 ms of a 148 ms
64-way decode step under torch.profiler. Five paired runs of `benchmarks/engine_throughput.py
--skip-hf --scenarios equal --output-len 64` at the commit before and the one after this
layout and the float32 greedy argmax (`farm-bench --vs`, 2-core machine) gave medians of 268
vs 235 output tokens/s. Each layer stores the new K/V through `kv_write_index`, then attends
with batched calls per group:

- decode: the G = h / kvh query heads that share a KV head are folded into the query-length
  axis, so GQA needs no K/V expansion: q [kvh, Bd, G, hd] x k [kvh, Bd, L, hd], masked by
  context length; two matmuls and a float32 softmax (`_decode_attention`), cheaper than SDPA at
  query length G.
- prefill: one SDPA call with the KV head as its batch axis and the sequence as its head axis;
  queries padded to [Bp, Qmax] and folded the same way to [kvh, Bp, G * Qmax, hd]; the mask is
  causal with each chunk's offset into its sequence.

On the CPU, when the engine kernels are loaded and the engine is float32 or bfloat16, decode
rows instead run `refkern::paged_attention_decode` (kernels/paged_attention.cpp): one call per
layer for all of them, reading each sequence's keys and values in place through its block
table (no gather, no padding, no mask), the GQA group sharing each K/V load; in a batch of
decode rows only it also stores their new K/V. Prefill rows keep the SDPA path. A pool may
store K/V in another format (`kv_dtype`: bfloat16, float16, int8 or fp8 with row scales): the
kernel reads it in place, the torch paths dequantise only the blocks they gather.

`AttentionMetadata` is built once per step (not per layer) by `build_attention_metadata`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_ref.core import kv_dtype
from engine_ref.core.kernels import attention_ops
from engine_ref.core.kv_dtype import KVPool

# A decode group's keys are padded to its longest context; a new group starts when a context
# exceeds DECODE_GROUP_SPAN times the group's shortest plus DECODE_GROUP_SLACK tokens, so padding
# wastes a bounded share of work and memory (contexts of 100 and 8,000 tokens are never gathered
# together) while short contexts still share one call.
DECODE_GROUP_SPAN = 1.5
DECODE_GROUP_SLACK = 16
# The most nodes a token tree may have for its ancestry to travel as one int64 per row.
TREE_BITS_MAX_NODES = 63


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows [start_row, end_row) of the batch, attended with one batched call. With
    the decode kernel there is one group of every decode row, and no kv_rows or mask."""

    start_row: int
    end_row: int
    block_tables: torch.Tensor  # [Bg, nb] long, on the CPU: what kv_rows was built from
    kv_rows: torch.Tensor | None  # [2 * kvh * Bg * nb] long: pool rows (head, block), head-major
    mask: torch.Tensor | None  # [Bg, 1, nb * block_size] additive: 0 = attend, -inf = masked


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer. Decode rows come first in the flattened batch.
    Slot mapping and block tables stay on the CPU: attention reads only the pool indexes
    derived from them (`kv_write_index`, `kv_rows`), which live on the pools' device."""

    slot_mapping: torch.Tensor  # [T] long: flat pool slot (block * block_size + offset) per row
    kv_write_index: torch.Tensor  # [2 * kvh * T] long: head * num_slots + slot, head-major
    num_decode_tokens: int
    decode_groups: tuple[DecodeGroup, ...]
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor | None  # [Bp, nbp] long (CPU)
    prefill_kv_rows: torch.Tensor | None  # [2 * kvh * Bp * nbp] long, like DecodeGroup.kv_rows
    prefill_q_index: torch.Tensor | None  # [Bp * Qmax] long: prefill row feeding each padded slot
    prefill_out_index: torch.Tensor | None  # [Tp] long: padded slot holding each prefill row
    prefill_mask: torch.Tensor | None  # [1, Bp, G * Qmax, Lp] additive, like DecodeGroup.mask
    prefill_q_max: int
    # True when a tree mask replaced the causal one for some prefill rows: a row then does not
    # attend to every position before it.
    has_tree_mask: bool = False
    # With tree masks of at most TREE_BITS_MAX_NODES nodes, per row [T] long (CPU), what the
    # fused layer reads instead of the masks: the positions (by slot) the row may see, the
    # first position of its tree (its context length when it is in none), and a bit per tree
    # node it attends (bit c: position tree_start + c). Also set, without trees, under KV
    # eviction: the fused layer otherwise takes a row's context from its (text) position.
    tree_context_lens: torch.Tensor | None = None
    tree_start: torch.Tensor | None = None
    tree_bits: torch.Tensor | None = None
    # [num_decode_tokens] long (CPU): each decode row's context length, set when the decode
    # rows run `refkern::paged_attention_decode` (then `decode_groups` is one group).
    decode_context_lens: torch.Tensor | None = None


def kv_pool_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """Shape of one layer's KV pool: key heads then value heads, each [num_blocks,
    block_size, head_dim]."""
    return (2 * num_kv_heads, num_blocks, block_size, head_dim)


def build_attention_metadata(
    *,
    start_positions: list[int],
    num_new_tokens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_queries_per_kv: int,
    num_kv_heads: int,
    num_pool_blocks: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    tree_masks: dict[int, torch.Tensor] | None = None,
    decode_kernel: bool | None = None,
    kv_evicted: bool = False,
) -> AttentionMetadata:
    """Metadata for one step over pools of `num_pool_blocks` blocks. Sequence i contributes
    `num_new_tokens[i]` rows at positions `start_positions[i]`, `start_positions[i] + 1`, ...;
    its KV lives in `block_tables[i]`, which must cover every position up to the last new one.
    Sequences with one new token must come before those with more (decode rows first); decode
    rows sorted by position group best. Masks are additive in `dtype`. `tree_masks[i]`, a
    bool [n, n] for sequence i's n > 1 new rows, replaces the causal mask among them (row r
    attends to row c where it is true; every row still sees all earlier positions): a token
    tree's rows attend to their ancestors only, while their KV lands in consecutive slots.
    `decode_kernel` True has the decode rows run `refkern::paged_attention_decode` (the
    kernels must be loaded), False the torch path; None picks the kernel when
    `attention_ops.decode_kernel_ok(device, dtype)`. Under KV eviction (`core.kv_eviction`)
    positions here are kept positions (text position less the tokens evicted before it) and
    tables hold the kept blocks; `kv_evicted` True, when some sequence's differ from its text
    positions, also sets the per-row context fields the fused layer reads."""
    num_decode = 0
    while num_decode < len(num_new_tokens) and num_new_tokens[num_decode] == 1:
        num_decode += 1
    if any(n == 1 for n in num_new_tokens[num_decode:]):
        raise ValueError("single-token rows must come first in the batch")

    slots: list[int] = []
    for start, n, table in zip(start_positions, num_new_tokens, block_tables, strict=True):
        for pos in range(start, start + n):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    heads = torch.arange(2 * num_kv_heads)[:, None]
    kv_write_index = (heads * (num_pool_blocks * block_size) + slot_mapping[None, :]).flatten()

    def pool_rows(tables: torch.Tensor) -> torch.Tensor:
        return (heads * num_pool_blocks + tables.flatten()[None, :]).flatten()

    if decode_kernel is None:
        decode_kernel = attention_ops.decode_kernel_ok(device, dtype)
    groups = []
    decode_context_lens = None
    if decode_kernel and num_decode:
        decode_context_lens = torch.tensor([s + 1 for s in start_positions[:num_decode]])
        tables = _pad_tables(block_tables[:num_decode], decode_context_lens, block_size)
        groups.append(DecodeGroup(0, num_decode, tables, None, None))
    bounds = [] if decode_context_lens is not None else start_positions[:num_decode]
    for lo, hi in _decode_group_bounds(bounds):
        context_lens = torch.tensor([s + 1 for s in start_positions[lo:hi]])
        tables = _pad_tables(block_tables[lo:hi], context_lens, block_size)
        span = tables.shape[1] * block_size
        mask = (torch.arange(span)[None, :] < context_lens[:, None]).view(-1, 1, span)
        groups.append(
            DecodeGroup(
                lo,
                hi,
                tables,
                pool_rows(tables).to(device, non_blocking=True),
                _additive(mask, dtype, device),
            )
        )

    prefill_tables = prefill_rows = q_index = out_index = prefill_mask = None
    q_max = 0
    num_prefill_tokens = sum(num_new_tokens[num_decode:])
    if num_prefill_tokens:
        starts = torch.tensor(start_positions[num_decode:])
        lens = torch.tensor(num_new_tokens[num_decode:])
        batch = len(lens)
        q_max = int(lens.max())
        context_lens = starts + lens
        prefill_tables = _pad_tables(block_tables[num_decode:], context_lens, block_size)
        prefill_rows = pool_rows(prefill_tables)
        span = prefill_tables.shape[1] * block_size
        offsets = torch.arange(q_max)
        valid = offsets[None, :] < lens[:, None]  # [Bp, Qmax]
        row_starts = torch.cumsum(lens, 0) - lens
        q_index = torch.where(valid, row_starts[:, None] + offsets[None, :], 0).flatten()
        out_index = (torch.arange(batch)[:, None] * q_max + offsets[None, :])[valid]
        query_pos = starts[:, None] + offsets[None, :]  # [Bp, Qmax]
        keys = torch.arange(span)
        mask = keys[None, None, :] <= query_pos[:, :, None]  # [Bp, Qmax, Lp]
        for i, allowed in (tree_masks or {}).items():
            b, start, n = i - num_decode, start_positions[i], num_new_tokens[i]
            mask[b, :n, start : start + n] &= allowed
        # Padded query rows attend to key 0 only, so no row is fully masked (SDPA would NaN).
        mask = torch.where(valid[:, :, None], mask, keys[None, None, :] == 0)
        g = num_queries_per_kv
        prefill_mask = mask[None, :, None].expand(1, batch, g, q_max, span)
        prefill_mask = prefill_mask.reshape(1, batch, g * q_max, span)

    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    tree_rows = _tree_rows(start_positions, num_new_tokens, tree_masks or {}, kv_evicted)

    return AttentionMetadata(
        slot_mapping=slot_mapping,
        kv_write_index=to(kv_write_index),
        num_decode_tokens=num_decode,
        decode_groups=tuple(groups),
        num_prefill_tokens=num_prefill_tokens,
        prefill_block_tables=prefill_tables,
        prefill_kv_rows=to(prefill_rows),
        prefill_q_index=to(q_index),
        prefill_out_index=to(out_index),
        prefill_mask=None if prefill_mask is None else _additive(prefill_mask, dtype, device),
        prefill_q_max=q_max,
        has_tree_mask=bool(tree_masks),
        decode_context_lens=decode_context_lens,
        **tree_rows,
    )


def _tree_rows(
    start_positions: list[int],
    num_new_tokens: list[int],
    tree_masks: dict[int, torch.Tensor],
    kv_evicted: bool = False,
) -> dict[str, torch.Tensor]:
    """The per-row tree fields of `AttentionMetadata` (empty without trees or KV eviction,
    or when a tree has more than TREE_BITS_MAX_NODES nodes)."""
    if not (tree_masks or kv_evicted) or any(
        m.shape[0] > TREE_BITS_MAX_NODES for m in tree_masks.values()
    ):
        return {}
    context_lens: list[int] = []
    tree_start: list[int] = []
    bits: list[int] = []
    for i, (start, n) in enumerate(zip(start_positions, num_new_tokens, strict=True)):
        allowed = tree_masks.get(i)
        rows = None if allowed is None else allowed.tolist()
        for r in range(n):
            context_lens.append(start + r + 1)
            if rows is None:
                tree_start.append(start + r + 1)
                bits.append(0)
            else:
                tree_start.append(start)
                bits.append(sum(1 << c for c, a in enumerate(rows[r]) if a))
    return {
        "tree_context_lens": torch.tensor(context_lens, dtype=torch.long),
        "tree_start": torch.tensor(tree_start, dtype=torch.long),
        "tree_bits": torch.tensor(bits, dtype=torch.long),
    }


def _additive(mask: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # SDPA would convert a boolean mask in every layer; convert once per step instead.
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return additive.to(device, non_blocking=True)


def _decode_group_bounds(positions: list[int]) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of consecutive decode rows whose contexts stay within
    DECODE_GROUP_SPAN of the range's shortest (positions sorted ascending give fewest groups)."""
    bounds = []
    lo = 0
    shortest = positions[0] + 1 if positions else 0
    for i in range(1, len(positions) + 1):
        if (
            i == len(positions)
            or positions[i] + 1 > DECODE_GROUP_SPAN * shortest + DECODE_GROUP_SLACK
        ):
            bounds.append((lo, i))
            lo = i
            if i < len(positions):
                shortest = positions[i] + 1
        else:
            shortest = min(shortest, positions[i] + 1)
    return bounds


def _pad_tables(
    tables: list[list[int]], context_lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[B, nb] block ids covering each context, padded with block 0 (masked out anyway)."""
    num_blocks = (int(context_lens.max()) + block_size - 1) // block_size
    padded = [t[:num_blocks] + [0] * (num_blocks - min(len(t), num_blocks)) for t in tables]
    return torch.tensor(padded, dtype=torch.long)


def gather_kv(
    kv_pool: KVPool, kv_rows: torch.Tensor, batch: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """[2 * kvh, batch, L, hd] keys and values of the pool rows `kv_rows` (built by
    `build_attention_metadata`: every head of each sequence's blocks, head-major), in `dtype`
    (the pool's when None): a pool in another storage (`kv_dtype`) is dequantised after the
    gather, so only these blocks are widened."""
    heads, _, _, head_dim = kv_pool.shape
    flat = kv_dtype.gather_blocks(kv_pool, kv_rows, dtype or kv_pool.dtype)
    return flat.view(heads, batch, -1, head_dim)


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention as two batched matmuls with a float32 softmax: q [kvh, B, G, hd],
    k and v [kvh, B, L, hd], additive mask [B, 1, L] -> [kvh, B, G, hd]. With G query rows per
    KV head, torch's CPU SDPA kernel spends more on per-head setup than on arithmetic: at
    64-way decode, context 192, bf16, 2 threads this took 2.3 ms per layer against SDPA's
    3.3 ms, and `benchmarks/engine_throughput.py --scenarios equal` ran 3-7% faster."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale).add_(mask)  # [kvh, B, G, L]
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_pool: KVPool,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention output [T, h, hd] for q [T, h, hd] and the new keys and values kv [T, 2 * kvh,
    hd] (keys in the first kvh heads). `kv_pool` [2 * kvh, num_blocks, block_size, hd] holds one
    layer's keys (heads :kvh) and values (heads kvh:), in q's dtype or another `kv_dtype`
    storage; the new rows are stored there first (converted or quantised)."""
    lens = meta.decode_context_lens
    if lens is not None and not meta.num_prefill_tokens:  # the kernel stores the new K/V too
        tables = meta.decode_groups[0].block_tables
        return attention_ops.paged_attention_decode(
            q, kv, kv_pool, meta.slot_mapping, tables, lens, scale
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv.shape[1] // 2
    kv_dtype.store_rows(kv_pool, meta.kv_write_index, kv.transpose(0, 1).reshape(-1, head_dim))
    g = num_heads // kv_heads
    parts = []
    nd = meta.num_decode_tokens
    if lens is not None:  # the kernel, after the new K/V of every row are stored above
        tables = meta.decode_groups[0].block_tables
        parts.append(
            attention_ops.paged_attention_decode(
                q[:nd], None, kv_pool, meta.slot_mapping, tables, lens, scale
            )
        )
    else:
        for group in meta.decode_groups:
            rows = group.end_row - group.start_row
            both = gather_kv(kv_pool, group.kv_rows, rows, q.dtype)  # [2kvh, Bg, L, hd]
            qd = q[group.start_row : group.end_row].view(rows, kv_heads, g, head_dim)
            out = _decode_attention(
                qd.transpose(0, 1), both[:kv_heads], both[kv_heads:], group.mask, scale
            )  # [kvh, Bg, G, hd]
            parts.append(out.transpose(0, 1).reshape(rows, num_heads, head_dim))
    if meta.num_prefill_tokens:
        batch = meta.prefill_block_tables.shape[0]
        q_max = meta.prefill_q_max
        qp = q[nd:].index_select(0, meta.prefill_q_index)  # [Bp * Qmax, h, hd]
        qp = qp.view(batch, q_max, kv_heads, g, head_dim).permute(2, 0, 3, 1, 4)
        qp = qp.reshape(kv_heads, batch, g * q_max, head_dim)  # [kvh, Bp, G * Qmax, hd]
        both = gather_kv(kv_pool, meta.prefill_kv_rows, batch, q.dtype)  # [2kvh, Bp, Lp, hd]
        out = F.scaled_dot_product_attention(
            qp, both[:kv_heads], both[kv_heads:], attn_mask=meta.prefill_mask, scale=scale
        )
        out = out.view(kv_heads, batch, g, q_max, head_dim).permute(1, 3, 0, 2, 4)
        out = out.reshape(batch * q_max, num_heads, head_dim)
        parts.append(out.index_select(0, meta.prefill_out_index))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
