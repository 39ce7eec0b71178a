"""Layouts and calls of the int8-activation GEMMs (`int8.cpp`): `refkern::q4_i8_gemm` (W4A8)
and `refkern::q8_i8_gemm` (W8A8).

Both quantise each activation row to int8 with its own scale (amax / 127), multiply in
integers (`vpdpbusd` under AVX-512 VNNI, `vpmaddubsw` + `vpmaddwd` without it) and scale once
per output, so their results are bit for bit the same at every instruction-set level. The
weights are packed once, at load, in blocks of 16 output rows (`int8.cpp` describes the
bytes); a packed weight holds N rounded up to 16 rows, so every call passes the true N.
Call `kernels.available()` first: these ops exist only when the library is loaded.
"""

from __future__ import annotations

import torch

BLOCK_ROWS = 16
GROUP = 32
Q4_CHUNK_BYTES = 320  # per (block, group): 256 bytes of nibbles, 16 f16 scales, 16 f16 minima
Q8_TAIL_BYTES = 128  # per block after its weights: 16 f32 scales, 16 i32 row sums
Q8_MAX_K = 65536


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def pack_q4_i8(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(N / 16), K / 32 * 320] for `q4_i8_gemm` from int4 groups: q [N, K] (values
    0..15), scale and minimum [N, K / 32] (rounded to float16, as Q4_1 stores them). Per block
    of 16 rows and group of 32 inputs: 4 runs of 16 rows x 4 bytes, byte b of row l in run t
    holding q[l, 8 t + b] in its low nibble and q[l, 8 t + 4 + b] in its high one; then the
    16 scales and the 16 minima. Rows past N are zero."""
    n, k = q.shape
    if k % GROUP or scale.shape != (n, k // GROUP) or minimum.shape != scale.shape:
        raise ValueError(
            f"pack_q4_i8 takes q [N, K] with K a multiple of {GROUP} and scale, minimum "
            f"[N, K / {GROUP}]; got {tuple(q.shape)}, {tuple(scale.shape)}, {tuple(minimum.shape)}."
        )
    blocks, groups = -(-n // BLOCK_ROWS), k // GROUP
    rows = blocks * BLOCK_ROWS
    nibbles = _pad_rows(q.to(torch.uint8), rows).view(blocks, BLOCK_ROWS, groups, 4, 2, 4)
    runs = nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)  # [B, l, g, t, b]
    runs = runs.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 256)

    def per_group(values: torch.Tensor) -> torch.Tensor:  # [N, G] -> [B, G, 32] bytes
        half = _pad_rows(values.half(), rows).view(blocks, BLOCK_ROWS, groups)
        return half.permute(0, 2, 1).contiguous().view(torch.uint8)

    chunks = torch.cat([runs, per_group(scale), per_group(minimum)], dim=2)
    return chunks.reshape(blocks, groups * Q4_CHUNK_BYTES).contiguous()


def pack_q8_i8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [ceil(N / 16), ceil(K / 4) * 64 + 128] for `q8_i8_gemm` from int8 weight [N, K]
    (within +-127) and float32 scale [N]: per block of 16 rows, runs of 16 rows x 4 inputs
    (zero past K), then the 16 scales and the 16 int32 row sums of the weights."""
    n, k = weight.shape
    if weight.dtype != torch.int8 or scale.shape != (n,) or k > Q8_MAX_K:
        raise ValueError(
            f"pack_q8_i8 takes an int8 weight [N, K <= {Q8_MAX_K}] and scale [N]; got "
            f"{weight.dtype} {tuple(weight.shape)} and {tuple(scale.shape)}."
        )
    if int(weight.min()) < -127:
        raise ValueError("pack_q8_i8 takes weights within +-127; -128 has no positive twin.")
    blocks, padded_k = -(-n // BLOCK_ROWS), -(-k // 4) * 4
    rows = blocks * BLOCK_ROWS
    w = torch.zeros(rows, padded_k, dtype=torch.int8)
    w[:n, :k] = weight
    runs = w.view(blocks, BLOCK_ROWS, padded_k // 4, 4).permute(0, 2, 1, 3).reshape(blocks, -1)
    scales = _pad_rows(scale.float(), rows).view(blocks, BLOCK_ROWS).contiguous()
    sums = w.sum(dim=1, dtype=torch.int32).view(blocks, BLOCK_ROWS)
    return torch.cat([runs, scales.view(torch.int8), sums.view(torch.int8)], dim=1).contiguous()


def q4_i8_gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """float32 [M, n] = x [M, K] @ W.T for int4 W packed by `pack_q4_i8`, with each row of x
    quantised to int8 (one scale per row)."""
    return torch.ops.refkern.q4_i8_gemm(x.float().contiguous(), packed, n)


def q8_i8_gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """float32 [M, n] = x [M, K] @ (W * scale[:, None]).T for int8 W packed by `pack_q8_i8`,
    with each row of x quantised to int8 (one scale per row)."""
    return torch.ops.refkern.q8_i8_gemm(x.float().contiguous(), packed, n)
