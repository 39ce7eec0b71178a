"""A small, fast reader for GGUF (v2/v3, little-endian): metadata and tensor views.

`gguf.GGUFReader` builds numpy views for every metadata element, which takes seconds for a
49k-token vocabulary; this reader decodes string arrays in one pass and maps tensor data lazily.
Tests check it against `gguf.GGUFReader`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine_ref.loading.model_files import GGUF_MAGIC, ModelFileError

_SCALARS = {  # GGUF value type -> (struct format, numpy dtype)
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `shape` in row-major (PyTorch) order, i.e. GGUF's dims reversed."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    data_offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFContents:
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        start = self.pos
        self.pos += length
        if self.pos > len(self.buf):
            raise ValueError("string runs past the end of the file")
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type = self.unpack("<I")
            count = self.unpack("<Q")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise ValueError("array runs past the end of the file")
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
                self.pos = end
                return values
            return [self.value(item_type) for _ in range(count)]
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type][0])
        raise ValueError(f"unknown GGUF value type {value_type}")


def read_gguf(path: Path, *, with_tensors: bool = True) -> GGUFContents:
    """Parse the header, all metadata and (optionally) the tensor table of a GGUF file.
    Raises `ModelFileError` when the file is not a readable GGUF v2/v3 file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            cur = _Cursor(mm)
            if mm[:4] != GGUF_MAGIC:
                raise ModelFileError(f"File {str(path)!r} is not a GGUF model file.")
            cur.pos = 4
            version = cur.unpack("<I")
            if version not in (2, 3):
                raise ModelFileError(
                    f"GGUF version {version} of {str(path)!r} is not supported (2 or 3 are)."
                )
            tensor_count = cur.unpack("<Q")
            kv_count = cur.unpack("<Q")
            metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key = cur.string()
                metadata[key] = cur.value(cur.unpack("<I"))
            tensors: list[TensorInfo] = []
            if with_tensors:
                raw = []
                for _ in range(tensor_count):
                    name = cur.string()
                    n_dims = cur.unpack("<I")
                    dims = [cur.unpack("<Q") for _ in range(n_dims)]
                    raw.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
                alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
                data_start = -(-cur.pos // alignment) * alignment
                for name, dims, ggml_type, offset in raw:
                    block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
                    n_elements = int(np.prod(dims))
                    nbytes = n_elements // block * type_bytes
                    start = data_start + offset
                    if start + nbytes > len(mm):
                        raise ValueError(f"tensor {name!r} runs past the end of the file")
                    tensors.append(
                        TensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)
                    )
    except (ValueError, struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ModelFileError(f"GGUF file {str(path)!r} is truncated or malformed ({exc}).") from exc
    return GGUFContents(version=version, metadata=metadata, tensors=tuple(tensors))


def tensor_bytes(path: Path, info: TensorInfo) -> np.ndarray:
    """The raw bytes of one tensor as a read-only uint8 memory map, shaped as `gguf.quants`
    expects: [rows..., bytes per row]."""
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=info.data_offset, shape=(info.nbytes,))
    data = data.view(np.ndarray)  # plain array: memmap subclass bookkeeping is slow per block
    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    return data.reshape(*info.shape[:-1], info.nbytes // rows) if len(info.shape) > 1 else data
