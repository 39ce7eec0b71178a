"""Attention metadata (hand-worked) and paged attention against a per-sequence loop."""

from __future__ import annotations

import math

import pytest
import torch

from engine_ref.core import kernels
from engine_ref.core.attention import build_attention_metadata, paged_attention

INF = float("-inf")


def test_metadata_hand_worked():
    # block_size 4. Row 0: decode at position 5 (table [3, 9]); row 1: prefill positions 2..4
    # (table [6, 2]).
    meta = build_attention_metadata(
        start_positions=[5, 2], num_new_tokens=[1, 3], block_tables=[[3, 9], [6, 2]],
        block_size=4, num_queries_per_kv=2, num_kv_heads=1, num_pool_blocks=10,
        device=torch.device("cpu"), decode_kernel=False,
    )  # fmt: skip
    assert meta.slot_mapping.tolist() == [9 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3, 2 * 4 + 0]
    # Pool [2 heads (key, value), 10 blocks, 4, hd] seen as 80 slots: value slots start at 40.
    assert meta.kv_write_index.tolist() == [37, 26, 27, 8, 77, 66, 67, 48]
    assert meta.num_decode_tokens == 1 and meta.num_prefill_tokens == 3
    (group,) = meta.decode_groups
    assert (group.start_row, group.end_row) == (0, 1)
    assert group.block_tables.tolist() == [[3, 9]]
    assert group.kv_rows.tolist() == [3, 9, 13, 19]  # key rows, then value rows (block + 10)
    assert group.mask.flatten().tolist() == [0.0] * 6 + [INF] * 2
    assert meta.prefill_block_tables.tolist() == [[6, 2]]
    assert meta.prefill_kv_rows.tolist() == [6, 2, 16, 12]
    assert meta.prefill_q_max == 3
    assert meta.prefill_q_index.tolist() == [0, 1, 2]
    assert meta.prefill_out_index.tolist() == [0, 1, 2]
    # Query at position p sees keys 0..p; the two query heads per KV head repeat the rows.
    rows = [[0.0] * (p + 1) + [INF] * (7 - p) for p in (2, 3, 4)]
    assert meta.prefill_mask.shape == (1, 1, 6, 8)
    assert meta.prefill_mask[0, 0].tolist() == rows + rows


def test_padded_prefill_rows():
    meta = build_attention_metadata(
        start_positions=[0, 4], num_new_tokens=[3, 2], block_tables=[[0], [1, 5]],
        block_size=4, num_queries_per_kv=1, num_kv_heads=1, num_pool_blocks=6,
        device=torch.device("cpu"),
    )  # fmt: skip
    assert meta.prefill_q_max == 3
    assert meta.prefill_q_index.tolist() == [0, 1, 2, 3, 4, 0]  # pad slot reads row 0
    assert meta.prefill_out_index.tolist() == [0, 1, 2, 3, 4]
    assert meta.prefill_block_tables.tolist() == [[0, 0], [1, 5]]  # padded with block 0
    pad_row = meta.prefill_mask[0, 1, 2].tolist()
    assert pad_row == [0.0] + [INF] * 7  # a padded query attends to key 0 only (no NaN)


def test_decode_rows_are_grouped_by_context_length():
    positions = [3, 5, 100, 120, 400]
    meta = build_attention_metadata(
        start_positions=positions, num_new_tokens=[1] * 5,
        block_tables=[list(range(p // 4 + 1)) for p in positions],
        block_size=4, num_queries_per_kv=1, num_kv_heads=1, num_pool_blocks=101,
        device=torch.device("cpu"), decode_kernel=False,
    )  # fmt: skip
    # Contexts 4, 6 | 101, 121 | 401: a group spans at most 1.5 x its shortest + 16 tokens.
    bounds = [(g.start_row, g.end_row) for g in meta.decode_groups]
    assert bounds == [(0, 2), (2, 4), (4, 5)]
    assert [g.block_tables.shape[1] for g in meta.decode_groups] == [2, 31, 101]


def test_decode_rows_must_come_first():
    with pytest.raises(ValueError):
        build_attention_metadata(
            start_positions=[0, 5], num_new_tokens=[3, 1], block_tables=[[0], [1, 2]],
            block_size=4, num_queries_per_kv=1, num_kv_heads=1, num_pool_blocks=3,
            device=torch.device("cpu"),
        )  # fmt: skip


@pytest.mark.parametrize(
    "decode_kernel",
    [
        False,
        pytest.param(True, marks=pytest.mark.skipif(
            not kernels.available(), reason="engine kernels off")),
    ],
)  # fmt: skip
def test_paged_attention_matches_per_sequence_loop(decode_kernel):
    gen = torch.Generator().manual_seed(0)
    h, kvh, hd, bs = 6, 2, 8, 4
    # Decode contexts 4 and 40 fall in different groups.
    starts, news = [3, 39, 0, 6], [1, 1, 5, 7]
    tables = [[2], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [5, 6], [0, 3, 8, 9]]
    pool = torch.randn(2 * kvh, 20, bs, hd, generator=gen)  # existing context: random
    total = sum(news)
    q = torch.randn(total, h, hd, generator=gen)
    kv = torch.randn(total, 2 * kvh, hd, generator=gen)
    meta = build_attention_metadata(
        start_positions=starts, num_new_tokens=news, block_tables=tables, block_size=bs,
        num_queries_per_kv=h // kvh, num_kv_heads=kvh, num_pool_blocks=20,
        device=torch.device("cpu"), decode_kernel=decode_kernel,
    )  # fmt: skip
    assert len(meta.decode_groups) == (1 if decode_kernel else 2)
    expected_pool = pool.clone()
    out = paged_attention(q, kv, pool, meta, scale=1 / math.sqrt(hd))

    row = 0
    for start, n, table in zip(starts, news, tables, strict=True):
        for j in range(n):  # store first, as the kernel does
            p = start + j
            expected_pool[:, table[p // bs], p % bs] = kv[row + j]
        ctx = start + n
        keys = torch.stack([expected_pool[:kvh, table[p // bs], p % bs] for p in range(ctx)])
        vals = torch.stack([expected_pool[kvh:, table[p // bs], p % bs] for p in range(ctx)])
        for j in range(n):
            for head in range(h):
                kv_head = head // (h // kvh)
                scores = keys[: start + j + 1, kv_head] @ q[row + j, head] / math.sqrt(hd)
                ref = scores.softmax(0) @ vals[: start + j + 1, kv_head]
                torch.testing.assert_close(out[row + j, head], ref, atol=1e-5, rtol=0)
        row += n
    torch.testing.assert_close(pool, expected_pool)
