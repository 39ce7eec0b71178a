"""KV between a pool and per-block tensors, in another layout: what a KV handoff
(`engine_ref.core.kv_handoff`) does on each side.

A layer's pool is [2 * kvh, num_blocks, block_size, hd] (`core.attention`), stored as
`core.kv_dtype` says. A handoff's block is [num_layers, 2 * kvh, tokens, hd]: all layers of one
block together, so a block is one record on the wire and can be checked on its own. `gather`
copies a sequence's blocks out of the pools; the decode side joins them along the token axis
(`join`), converts the storage dtype (`convert`), cuts them into its own block size by token
position (`reblock`) and writes them into its blocks (`write`). float8 is moved as uint8 bytes:
torch's CPU copies and index ops do not all take float8.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine_ref.core import kv_dtype
from engine_ref.core.kv_dtype import KVFormat, KVPool, QuantizedKVPool

__all__ = [
    "convert",
    "dequantize",
    "gather",
    "join",
    "raw",
    "reblock",
    "slot_runs",
    "write",
    "write_blocks",
]

Blocks = list[tuple[torch.Tensor, torch.Tensor | None]]  # per block: kv, scales (or None)


def raw(t: torch.Tensor) -> torch.Tensor:
    """float8 viewed as uint8; other dtypes as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _gather_nbytes(pools: Sequence[KVPool], fmt: KVFormat, num_tokens: int, block_size: int) -> int:
    """Bytes of the buffer `gather` fills for `num_tokens` tokens."""
    num_blocks = -(-num_tokens // block_size)
    heads, _, _, head_dim = pools[0].shape
    rows = num_blocks * len(pools) * heads * block_size
    return rows * head_dim * fmt.storage.itemsize + (4 * rows if fmt.scaled else 0)


def gather(
    pools: Sequence[KVPool],
    fmt: KVFormat,
    table: list[int],
    num_tokens: int,
    block_size: int,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> Blocks:
    """Copies, on the CPU, of the blocks `table` that hold `num_tokens` tokens: per block kv
    [L, 2 * kvh, tokens, hd] in `fmt.storage` and, when scaled, scales [L, 2 * kvh, tokens]
    (the last block cut to the tokens it holds). The copies go into one uint8 buffer that
    `allocate(nbytes)` returns (a buffer written before copies several times faster than a
    fresh one: `core.staging`), by default a new one; the blocks are views of it."""
    num_blocks = -(-num_tokens // block_size)
    device = pools[0].device
    index = torch.tensor(table[:num_blocks], dtype=torch.long, device=device)
    heads, _, _, head_dim = pools[0].shape
    raw_dtype = raw(torch.empty(0, dtype=fmt.storage)).dtype
    shape = (num_blocks, len(pools), heads, block_size, head_dim)
    nbytes = _gather_nbytes(pools, fmt, num_tokens, block_size)
    out = allocate(nbytes) if allocate is not None else torch.empty(nbytes, dtype=torch.uint8)
    kv_bytes = shape[0] * shape[1] * shape[2] * shape[3] * head_dim * fmt.storage.itemsize
    kv = out[:kv_bytes].view(raw_dtype).view(shape)
    scales = None
    if fmt.scaled:  # after the kv in `out` when aligned for float32
        aligned = kv_bytes % 4 == 0
        scales = out[kv_bytes:].view(torch.float32) if aligned else torch.empty(shape[:-1])
        scales = scales.view(shape[:-1])
    runs = slot_runs(table[:num_blocks])
    for layer, pool in enumerate(pools):
        if isinstance(pool, QuantizedKVPool):
            assert scales is not None
            pairs = [(raw(pool.values), kv), (pool.scales, scales)]
        else:
            pairs = [(raw(pool), kv)]
        for source, buffer in pairs:
            target = buffer[:, layer]  # [nb, 2 * kvh, bs(, hd)]
            if runs is not None:  # consecutive slots: plain strided copies
                for start, slot, count in runs:
                    target[start : start + count] = source[:, slot : slot + count].transpose(0, 1)
            elif device.type == "cpu":  # scattered: one indexed copy straight into the buffer
                torch.index_select(source, 1, index, out=target.transpose(0, 1))
            else:
                target.copy_(source.index_select(1, index).transpose(0, 1))
    kv = kv.view(fmt.storage)
    blocks: Blocks = []
    for j in range(num_blocks):
        count = min(block_size, num_tokens - j * block_size)
        block_kv = kv[j, :, :, :count]
        block_scales = None if scales is None else scales[j, :, :, :count]
        if count < block_size:  # the last, partial block: its own contiguous copy
            block_kv = block_kv.contiguous()
            block_scales = None if block_scales is None else block_scales.contiguous()
        blocks.append((block_kv, block_scales))
    return blocks


def join(blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Blocks joined along the token axis: kv [L, 2 * kvh, n, hd], scales [L, 2 * kvh, n]."""
    kv = torch.cat([raw(b) for b, _ in blocks], dim=2).view(blocks[0][0].dtype)
    if blocks[0][1] is None:
        return kv, None
    return kv, torch.cat([s for _, s in blocks], dim=2)  # type: ignore[misc]


def dequantize(kv: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """K/V rows [..., hd] as float32 values: what attention reads from them."""
    return kv.float() if scales is None else kv_dtype.dequantize_rows(kv, scales, torch.float32)


def convert(
    kv: torch.Tensor, scales: torch.Tensor | None, target: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K/V rows [..., hd] (with their scales when int8/fp8) in `target` storage: dequantised
    to float32, then cast, or quantised by the pools' own rule (`kv_dtype.quantize_rows`)."""
    if kv.dtype == target:
        return kv, scales
    x = dequantize(kv, scales)
    if not KVFormat(target).scaled:
        return x.to(target), None
    values, new_scales = kv_dtype.quantize_rows(x.reshape(-1, x.shape[-1]), target)
    return values.view(x.shape), new_scales.view(x.shape[:-1])


def reblock(
    kv: torch.Tensor, scales: torch.Tensor | None, block_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-major kv [L, 2 * kvh, n, hd] (scales [L, 2 * kvh, n]) cut into blocks of
    `block_size` by token position: [L, 2 * kvh, nb, block_size, hd] (scales [..., nb,
    block_size]), the last block's unused slots zero."""
    layers, heads, n = kv.shape[:3]
    nb = -(-n // block_size)
    kv_raw = raw(kv)
    padded = kv_raw.new_zeros((layers, heads, nb * block_size, *kv_raw.shape[3:]))
    padded[:, :, :n] = kv_raw
    blocked = padded.view(layers, heads, nb, block_size, *kv_raw.shape[3:]).view(kv.dtype)
    if scales is None:
        return blocked, None
    padded_scales = scales.new_zeros((layers, heads, nb * block_size))
    padded_scales[:, :, :n] = scales
    return blocked, padded_scales.view(layers, heads, nb, block_size)


def write(
    pools: Sequence[KVPool], table: list[int], kv: torch.Tensor, scales: torch.Tensor | None
) -> None:
    """Write blocked kv [L, 2 * kvh, nb, bs, hd] (scales [L, 2 * kvh, nb, bs]), already in the
    pools' storage, into blocks `table` of every layer's pool."""
    device = pools[0].device
    index = torch.tensor(table, dtype=torch.long, device=device)
    for layer, pool in enumerate(pools):
        if isinstance(pool, QuantizedKVPool):
            assert scales is not None
            raw(pool.values).index_copy_(1, index, raw(kv[layer]).to(device))
            pool.scales.index_copy_(1, index, scales[layer].to(device))
        else:
            pool.index_copy_(1, index, kv[layer].to(device))


def write_blocks(pools: Sequence[KVPool], table: list[int], blocks: Blocks) -> None:
    """Write per-block kv [L, 2 * kvh, tokens, hd] (scales [L, 2 * kvh, tokens]), already in
    the pools' storage and of the pools' block size (the last may hold fewer tokens), into
    blocks `table`: each straight into its slot. The general path (`join`, `reblock`, `write`)
    makes three fresh copies of the whole KV first; for a 2,048-token SmolLM2 handoff (47 MB)
    that was 110 ms of the install against about 20 ms this way. Full blocks that lie evenly
    spaced in one buffer (a received handoff's: `cluster.kv_link`) go in together: one strided
    copy per layer and run of consecutive slots (`slot_runs`; one for all layers when the pools
    share one allocation: `_stacked`), or one indexed copy per layer when the slots are
    scattered (3.9 ms for that handoff, against 10.0 with indexed copies only and 18 block by
    block)."""
    run = _evenly_spaced(blocks)
    if run is not None:
        n = run.shape[0]
        runs = slot_runs(table[:n])
        stacked = _stacked(pools) if runs is not None else None
        if stacked is not None:  # one copy a run, every layer at once
            source = raw(run).permute(1, 2, 0, 3, 4).to(stacked.device)  # [L, 2kvh, n, bs, hd]
            for start, slot, count in runs:
                stacked[:, :, slot : slot + count] = source[:, :, start : start + count]
        else:
            _write_layers(pools, table[:n], run, runs)
        table, blocks = table[n:], blocks[n:]
    for j, (kv, scales) in enumerate(blocks):
        slot, count = table[j], kv.shape[2]
        for layer, pool in enumerate(pools):
            if isinstance(pool, QuantizedKVPool):
                assert scales is not None
                raw(pool.values)[:, slot, :count].copy_(raw(kv[layer]))
                pool.scales[:, slot, :count].copy_(scales[layer])
            else:
                pool[:, slot, :count].copy_(kv[layer])


def _write_layers(pools: Sequence[KVPool], table: list[int], run: torch.Tensor, runs) -> None:
    """`write_blocks`' evenly spaced blocks `run` [n, L, 2 * kvh, bs, hd] a layer at a time:
    a strided copy per run of slots (`runs`), or one indexed copy when they are scattered."""
    if runs is None:
        index = torch.tensor(table, dtype=torch.long, device=pools[0].device)
    for layer, pool in enumerate(pools):
        source = raw(run[:, layer]).transpose(0, 1).to(pool.device)  # [2 * kvh, n, bs, hd]
        if runs is None:
            raw(pool).index_copy_(1, index, source)
            continue
        for start, slot, count in runs:
            raw(pool)[:, slot : slot + count] = source[:, start : start + count]


def _stacked(pools: Sequence[KVPool]) -> torch.Tensor | None:
    """Plain pools that lie layer after layer in one allocation (`kv_dtype.allocate_pools`)
    as one [L, 2 * kvh, num_blocks, bs, hd] view (raw dtype), else None. A landing's write of
    16 SmolLM2 blocks took 0.25 ms as a copy per layer and 0.13 ms as one (1 block: 0.12 and
    0.01 ms), the copies' own cost gone."""
    if not all(isinstance(pool, torch.Tensor) for pool in pools):
        return None
    view = _equal_steps(list(pools))
    if view is None or view.shape[0] < len(pools) or view.stride(0) != pools[0].numel():
        return None  # not every layer, or not back to back
    return raw(view)


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]] | None:
    """`slots` as runs of consecutive block ids, (position in `slots`, first id, length) each,
    or None when they are too scattered for that to pay: a run is one strided copy per layer
    (3.0 against 7.0 ms of indexed copies for a 128-block SmolLM2 gather on one thread, 3.1
    against 13.2 for the write), each with a few microseconds of Python around it."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and slot == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, slot, 1))
    return runs if 4 * len(runs) <= len(slots) else None


def _evenly_spaced(blocks: Blocks) -> torch.Tensor | None:
    """The leading full, unscaled blocks as one [n, L, 2 * kvh, bs, hd] view when they lie at
    equal steps in one storage (else None): each contiguous, the same shape, dtype and step."""
    if len(blocks) < 2 or blocks[0][1] is not None:
        return None
    view = _equal_steps([kv for kv, _ in blocks])
    return None if view is None or view.shape[0] < 2 else view


def _equal_steps(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The leading `tensors` that lie at equal steps in one storage, without overlapping, as
    one [n, *shape] view (n >= 1; each contiguous, of the first's shape and dtype), or None
    when the first is not contiguous."""
    first = tensors[0]
    if not first.is_contiguous():
        return None
    storage, step = first.untyped_storage().data_ptr(), first.numel()
    n = 1
    for t in tensors[1:]:
        if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            break
        if t.untyped_storage().data_ptr() != storage:
            break
        gap = t.storage_offset() - first.storage_offset()
        next_step = gap if n == 1 else step  # the second tensor sets the step
        if next_step < first.numel() or gap != next_step * n:  # overlapping, or off the step
            break
        step, n = next_step, n + 1
    return first.as_strided((n, *first.shape), (step, *first.stride()))
