"""How the KV pools store keys and values: `EngineConfig.kv_cache_dtype` (`--kv-cache-dtype`).

`auto` stores them in the engine's dtype (float32 or bfloat16), as a plain tensor per layer:
exactly the pool the engine had before this option. `bf16` and `fp16` store them in that dtype,
also a plain tensor (on a bfloat16 engine `bf16` is `auto`). `int8` and `fp8_e4m3` store one
byte a value plus one float32 scale per row: a row is one (K or V head, slot), `head_dim` values,
so a `QuantizedKVPool` is values [2 * kvh, num_blocks, block_size, hd] beside scales
[2 * kvh, num_blocks, block_size]. A row's scale is written once, with the row, so appending
tokens to a partly filled block never rescales the rows already there; and every move of KV
(copy-on-write, a speculative tree's accepted path) moves the scales with the values. A
`self_draft` drafter reads and writes the target's pools, so their format; a `draft_model`'s
own pools stay in the engine's dtype (they are not counted in the pool bytes either).

int8 is symmetric: scale = absmax / 127, value = round-half-even(x / scale). fp8_e4m3 is
torch.float8_e4m3fn with scale = absmax / 448 (its largest finite value), x / scale rounded by
torch's own conversion (the C kernel uses the same c10 routine, so both stores write the same
bits). A zero row has scale 0 and zero values.

Scales are float32, not float16. For SmolLM2 (30 layers, 3 KV heads, head_dim 64) a token
holds 2 x 30 x 3 = 180 rows: 11,520 value bytes in int8, plus 720 bytes of float32 scales
(12,240 bytes, 53% of bfloat16's 23,040) or 360 of float16 ones (11,880, 52%). float16 scales
would buy 3% more tokens, but a row of absmax below 127 x 2^-14 (about 0.008) would get a
subnormal scale with fewer significant bits, and the decode kernel would pay a conversion per
row; float32 keeps the scale exact for any row.

The C kernels read these bytes in place and dequantise in registers: the fused decoder layer
(`refkern::decode_layer`, small batches, decode and prefill rows alike) and, when the layers run
one by one, the decode kernel (`refkern::paged_attention_decode`); both store new rows as
`store_rows` does, from the same C helpers (`kernels/kv_formats.h`). The prefill and torch
paths gather the batch's blocks and dequantise only those (`gather_blocks`). Nothing makes a
float copy of a whole pool. The fused layer quantises K/V from its float32 rows, where the
layers run one by one in the engine's dtype: a bfloat16 engine's layer-by-layer path rounds
each row to bfloat16 before quantising it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "KV_CACHE_DTYPES",
    "KVFormat",
    "KVPool",
    "QuantizedKVPool",
    "allocate_pool",
    "allocate_pools",
    "copy_blocks",
    "copy_slots",
    "dequantize_rows",
    "gather_blocks",
    "kv_cache_dtype_problem",
    "pool_nbytes",
    "quantize_rows",
    "resolve_kv_format",
    "store_rows",
]

KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "int8", "fp8_e4m3")
SCALE_DTYPE = torch.float32
# The largest magnitude each scaled storage dtype holds: a row's absmax maps to it.
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_NAMED = {"bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8,
          "fp8_e4m3": torch.float8_e4m3fn}  # fmt: skip


def kv_cache_dtype_problem(value: object) -> str | None:
    """One sentence when `value` is not a `kv_cache_dtype`; None when it is."""
    if value in KV_CACHE_DTYPES:
        return None
    return f"Unknown kv_cache_dtype {value!r}; use one of {', '.join(KV_CACHE_DTYPES)}."


@dataclass(frozen=True)
class KVFormat:
    """A pool's storage: `storage` the dtype of its values; `scaled` when each row has a
    float32 scale beside it (int8, float8_e4m3fn)."""

    storage: torch.dtype

    @property
    def scaled(self) -> bool:
        return self.storage in _QMAX

    @property
    def qmax(self) -> float:
        return _QMAX[self.storage]

    @property
    def name(self) -> str:
        """The storage dtype's name ("int8", "bfloat16", ...): what a prefix-cache key binds."""
        return str(self.storage).removeprefix("torch.")

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token's K and V take in every layer: values plus scales."""
        row = head_dim * self.storage.itemsize + (SCALE_DTYPE.itemsize if self.scaled else 0)
        return 2 * num_layers * num_kv_heads * row


def resolve_kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """The storage of `kv_cache_dtype` for an engine computing in `model_dtype`."""
    if kv_cache_dtype == "auto":
        return KVFormat(model_dtype)
    return KVFormat(_NAMED[kv_cache_dtype])


@dataclass(frozen=True)
class QuantizedKVPool:
    """One layer's int8 or fp8 pool: `values` [2 * kvh, num_blocks, block_size, hd] and
    `scales` [2 * kvh, num_blocks, block_size] float32 (one per row of hd values)."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    def element_size(self) -> int:
        """Bytes of one stored value (its row's scale apart), as `Tensor.element_size`."""
        return self.values.element_size()


# A layer's pool: a plain tensor (auto, bf16, fp16) or values with scales (int8, fp8_e4m3).
KVPool = torch.Tensor | QuantizedKVPool


def allocate_pool(fmt: KVFormat, shape: tuple[int, ...], device: torch.device) -> KVPool:
    """A zeroed pool of `shape` ([2 * kvh, num_blocks, block_size, hd]) in `fmt`. Zeroed, not
    empty: masked slots are multiplied by 0 and must not hold NaN."""
    values = torch.zeros(shape, dtype=fmt.storage, device=device)
    if not fmt.scaled:
        return values
    return QuantizedKVPool(values, torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device))


def allocate_pools(
    fmt: KVFormat, shape: tuple[int, ...], device: torch.device, num_layers: int
) -> list[KVPool]:
    """`num_layers` zeroed pools of `shape` (as `allocate_pool`), views of one allocation
    layer after layer, so a copy into the same blocks of every layer can be one copy
    (`kv_layout.write_blocks`); each layer's pool is contiguous on its own as before."""
    values = torch.zeros((num_layers, *shape), dtype=fmt.storage, device=device)
    if not fmt.scaled:
        return list(values.unbind(0))
    scales = torch.zeros((num_layers, *shape[:-1]), dtype=SCALE_DTYPE, device=device)
    return [QuantizedKVPool(v, s) for v, s in zip(values.unbind(0), scales.unbind(0), strict=True)]


def pool_nbytes(pool: KVPool) -> int:
    """Bytes a pool holds (values and scales)."""
    if isinstance(pool, QuantizedKVPool):
        return _nbytes(pool.values) + _nbytes(pool.scales)
    return _nbytes(pool)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """float8 viewed as uint8: torch's CPU index_copy_ does not take float8."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def quantize_rows(rows: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [N, hd] (any float dtype) -> values [N, hd] in `storage` (int8 or float8_e4m3fn)
    and scales [N] float32: scale = absmax / qmax (0 for a zero row), value = x / scale rounded
    (half to even for int8, torch's float8 conversion for fp8)."""
    x = rows.float()
    scales = x.abs().amax(dim=-1) / _QMAX[storage]
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = x / divisor[:, None]
    if storage == torch.int8:
        values = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        values = scaled.clamp_(-448, 448).to(storage)
    return values, scales


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., hd] times scales [...] in float32, returned in `dtype`."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


def store_rows(pool: KVPool, index: torch.Tensor, rows: torch.Tensor) -> None:
    """Write rows [N, hd] at flat row `index` [N] (head * num_slots + slot) of the pool,
    converted or quantised to its storage."""
    head_dim = rows.shape[-1]
    if isinstance(pool, QuantizedKVPool):
        values, scales = quantize_rows(rows, pool.dtype)
        _raw(pool.values).view(-1, head_dim).index_copy_(0, index, _raw(values))
        pool.scales.view(-1).index_copy_(0, index, scales)
        return
    pool.view(-1, head_dim).index_copy_(0, index, rows.to(pool.dtype))


def gather_blocks(pool: KVPool, kv_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R, block_size * hd] in `dtype`: the pool rows `kv_rows` (one (head, block) each),
    dequantised after the gather, so only these blocks are widened."""
    _, _, block_size, head_dim = pool.shape
    if isinstance(pool, QuantizedKVPool):
        values = pool.values.view(-1, block_size, head_dim).index_select(0, kv_rows)
        scales = pool.scales.view(-1, block_size).index_select(0, kv_rows)
        return dequantize_rows(values, scales, dtype).view(-1, block_size * head_dim)
    return pool.view(-1, block_size * head_dim).index_select(0, kv_rows).to(dtype)


def copy_blocks(pool: KVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src[i] -> dst[i] in every head, values and scales."""
    for t in _tensors(pool):
        t.index_copy_(1, dst, t.index_select(1, src))


def copy_slots(pool: KVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy flat slots (block * block_size + offset) src[i] -> dst[i] in every head, values
    and scales; sources are read before any destination is written."""
    heads, num_blocks, block_size = pool.shape[:3]
    for t in _tensors(pool):
        flat = t.view(heads, num_blocks * block_size, -1)  # [2 * kvh, slots, hd or 1]
        flat.index_copy_(1, dst, flat.index_select(1, src))


def _tensors(pool: KVPool) -> tuple[torch.Tensor, ...]:
    if isinstance(pool, QuantizedKVPool):
        return (_raw(pool.values), pool.scales)
    return (pool,)
