"""Dequantise GGUF tensor bytes to float32 torch tensors.

F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are decoded with whole-tensor torch ops (several times
faster than `gguf.quants`, which tests use as the oracle); every other type `gguf.quants`
supports goes through `gguf.quants.dequantize`.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_ref.core.quant import Int4Groups
from engine_ref.loading.model_files import ModelFileError

# ggml block layouts (ggml-common.h): 32 values per block
_QK = 32
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 scalar at byte `start` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values: low nibbles are elements 0-15, high nibbles 16-31."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1).float()


def int4_groups(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> Int4Groups | None:
    """The 4-bit values, scales and minima of a Q4_0 or Q4_1 matrix as stored (groups of 32
    along its rows), or None for any other type."""
    if ggml_type not in (_Q4_0, _Q4_1) or len(shape) != 2:
        return None
    rows, cols = shape
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True).reshape(-1))
    header = 2 if ggml_type == _Q4_0 else 4
    blocks = data.reshape(-1, header + _QK // 2)
    q = torch.cat([blocks[:, header:] & 0x0F, blocks[:, header:] >> 4], dim=1).reshape(shape)
    scale = _halves(blocks, 0).reshape(rows, cols // _QK)
    if ggml_type == _Q4_0:
        minimum = -8.0 * scale
    else:
        minimum = _halves(blocks, 2).reshape(rows, cols // _QK)
    return Int4Groups(q.contiguous(), scale, minimum)


def dequantize_to_torch(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode the raw bytes of one tensor (any shape of uint8 holding exactly its data) into a
    float32 tensor of `shape` (row-major, PyTorch order). Raises `ModelFileError` for a type
    that cannot be decoded."""
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True).reshape(-1))
    if ggml_type == _F32:
        return data.view(torch.float32).reshape(shape).clone()
    if ggml_type == _F16:
        return data.view(torch.float16).float().reshape(shape)
    if ggml_type == _BF16:
        return data.view(torch.bfloat16).float().reshape(shape)
    if ggml_type == _Q8_0:
        blocks = data.reshape(-1, 2 + _QK)
        values = blocks[:, 2:].contiguous().view(torch.int8).float() * _halves(blocks, 0)
        return values.reshape(shape)
    if ggml_type == _Q4_0:
        blocks = data.reshape(-1, 2 + _QK // 2)
        values = (_nibbles(blocks[:, 2:]) - 8.0) * _halves(blocks, 0)
        return values.reshape(shape)
    if ggml_type == _Q4_1:
        blocks = data.reshape(-1, 4 + _QK // 2)
        values = _nibbles(blocks[:, 4:]) * _halves(blocks, 0) + _halves(blocks, 2)
        return values.reshape(shape)
    return _dequantize_with_gguf(raw, ggml_type, shape)


def _dequantize_with_gguf(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(ggml_type)
        values = dequantize(np.asarray(raw, dtype=np.uint8), qtype)
    except (ValueError, NotImplementedError) as exc:
        raise ModelFileError(
            f"GGUF tensor type {ggml_type} cannot be dequantised ({exc})."
        ) from exc
    return torch.tensor(np.asarray(values, dtype=np.float32)).reshape(shape)
