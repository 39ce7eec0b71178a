"""Python face of `refkern::paged_attention_decode` (paged_attention.cpp): decode rows attend
to their contexts straight from the paged KV pool through their block tables, in whichever
storage the pool has (`engine_ref.core.kv_dtype`: the engine's dtype, bfloat16, float16, or
int8 or fp8 values with their scales), read in place."""

from __future__ import annotations

import torch

from engine_ref.core import kernels
from engine_ref.core.kv_dtype import KVPool, QuantizedKVPool

# The engine dtypes the kernel takes (q, the new keys and values, and the output); the pool
# is any `kv_dtype` storage.
DECODE_DTYPES = (torch.float32, torch.bfloat16)


def decode_kernel_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode rows over a pool of `dtype` on `device` can run the kernel. Does not
    hold the caller for a first build: when the library is not built yet, a background build
    starts and this says False until a later call finds it (see `kernels.available`)."""
    return device.type == "cpu" and dtype in DECODE_DTYPES and kernels.available(build=False)


def paged_attention_decode(
    q: torch.Tensor,
    kv: torch.Tensor | None,
    kv_pool: KVPool,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention output [T, h, hd] in q's dtype for the decode rows q [T, h, hd]: row t attends
    to positions 0 .. context_lens[t] - 1 of its sequence, stored in the blocks
    `block_tables[t]` ([T, nb] int64) of `kv_pool` [2 * kvh, num_blocks, block_size, hd]
    (keys in heads :kvh). When `kv` [T, 2 * kvh, hd] is given, row t's new keys and values
    are stored at pool slot `slots[t]` first (quantised for an int8 or fp8 pool); None means
    they are there already."""
    new = kv if kv is not None else q.new_empty(0)
    values, scales = kv_pool, None
    if isinstance(kv_pool, QuantizedKVPool):
        values, scales = kv_pool.values, kv_pool.scales
    return torch.ops.refkern.paged_attention_decode(
        q, new, values, slots, block_tables, context_lens, scale, scales
    )
