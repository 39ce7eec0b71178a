"""The KV link: a `KVHandoff` (`engine_ref.core.kv_handoff`) on the wire, each block checksummed.

A decode worker must never decode from a block that changed on the way, and must know when a
transfer stopped short, so the framing makes both detectable before anything is handed on:

    header   b"KVH1" | u32 header length | u32 crc32c(header) | header (JSON, UTF-8)
    block i  u32 i | u32 crc32c(u32 i, payload) | payload (the header's `block_nbytes[i]` bytes)

Integers are little-endian. The JSON header holds the handoff's metadata, the block count and
each block's token count and byte length; a payload is the block's K/V bytes as its tensor holds
them ([layers, 2 * kv heads, tokens, head_dim], native byte order, recorded in the header), then
for int8/fp8 its float32 scales. The checksum (CRC-32C, the `crc32c` package) covers the index,
so a block out of place fails like a block with a flipped bit.

`encode` yields the frames as views of the handoff's tensors (no copy of all blocks at once);
`HandoffDecoder` takes bytes as they come, verifies each block's checksum as soon as the block is
complete (`KVChecksumError` names it) and returns the handoff only when every block has passed;
a stream that ends early is `KVLinkCut`. Once the header has given every block's size, the rest
of the stream lands in one area laid out as on the wire (records and payloads), so a socket can
receive into it directly (`writable`, `wrote`) and the blocks are views of it. Transports: TCP
(`cluster.kv_tcp`: `send_handoff` and `KVReceiver`) and shared memory (`write_shm` /
`read_shm`: the same frames in a `multiprocessing.shared_memory` segment that the reader unlinks
after reading, on success and on error alike).
"""

from __future__ import annotations

import base64
import itertools
import json
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import fields
from multiprocessing import resource_tracker, shared_memory

import crc32c
import torch

from engine_ref.core.kv_handoff import KV_STORAGE, KVBlock, KVHandoff
from engine_ref.core.staging import StagingBuffers

__all__ = [
    "HandoffDecoder",
    "KVChecksumError",
    "KVLinkCut",
    "KVLinkError",
    "KVTransferRejected",
    "StagingBuffers",
    "decode",
    "encode",
    "encoded_size",
    "read_shm",
    "write_shm",
]

MAGIC = b"KVH1"
VERSION = 1
_PREFIX = struct.Struct("<4sII")  # magic, header length, header crc32c
_RECORD = struct.Struct("<II")  # block index, crc32c(index, payload)
MAX_HEADER_BYTES = 64 << 20
DEFAULT_MAX_BYTES = 16 << 30  # the most KV bytes one handoff may announce


class KVLinkError(RuntimeError):
    """A KV transfer that cannot be used; the message is one sentence."""


class KVChecksumError(KVLinkError):
    """A block (or the header: `block_index` None) whose bytes fail their checksum."""

    def __init__(self, block_index: int | None) -> None:
        where = "header" if block_index is None else f"block {block_index}"
        super().__init__(f"The KV transfer's {where} failed its CRC-32C checksum.")
        self.block_index = block_index


class KVLinkCut(KVLinkError):
    """The stream ended after `received_bytes`, before the handoff was complete."""

    def __init__(self, received_bytes: int, expected: str) -> None:
        super().__init__(
            f"The KV transfer ended after {received_bytes} bytes, in the middle of {expected}."
        )
        self.received_bytes = received_bytes


class KVTransferRejected(KVLinkError):
    """The receiver did not take the handoff: `kind` names its error class, `reason` says why."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"The receiver rejected the KV handoff ({kind}): {reason}")
        self.kind, self.reason = kind, reason


# -- framing ------------------------------------------------------------------------------------
def _parts(block: KVBlock) -> list[memoryview]:
    """The block's payload as byte views of its tensors (copied only if not contiguous)."""
    tensors = [block.kv] if block.scales is None else [block.kv, block.scales]
    return [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for t in tensors]


def _header(handoff: KVHandoff, block_nbytes: list[int], extra: dict | None = None) -> bytes:
    meta = {f.name: getattr(handoff, f.name) for f in fields(handoff) if f.name != "blocks"}
    if extra is not None:  # what the receiver needs besides the handoff (a P/D request's params)
        meta["extra"] = extra
    state = handoff.generator_state
    meta.update(
        version=VERSION,
        byteorder=sys.byteorder,
        token_ids=list(handoff.token_ids),
        generator_state=None if state is None else base64.b64encode(state).decode(),
        block_num_tokens=[b.num_tokens for b in handoff.blocks],
        block_nbytes=block_nbytes,
    )
    body = json.dumps(meta, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, len(body), crc32c.crc32c(body)) + body


def encode(handoff: KVHandoff, *, extra: dict | None = None) -> Iterator[bytes | memoryview]:
    """The handoff's frames (module doc), in order; blocks as views of their tensors. `extra`
    (JSON) travels in the header, under its checksum (`HandoffDecoder.extra`)."""
    parts = [_parts(b) for b in handoff.blocks]
    yield _header(handoff, [sum(p.nbytes for p in block) for block in parts], extra)
    for index, block in enumerate(parts):
        prefix = struct.pack("<I", index)
        crc = crc32c.crc32c(prefix)
        for part in block:
            crc = crc32c.crc32c(part, crc)
        yield _RECORD.pack(index, crc)
        yield from block


def encoded_size(handoff: KVHandoff) -> int:
    """Bytes `encode` yields in all."""
    sizes = [sum(p.nbytes for p in _parts(b)) for b in handoff.blocks]
    return len(_header(handoff, sizes)) + sum(_RECORD.size + size for size in sizes)


class HandoffDecoder:
    """Incremental decoding: `feed` bytes as they arrive (or receive straight into `writable()`
    and report with `wrote(n)`), then `result()`. A block's checksum is verified when its last
    byte arrives; the first failure raises and ends the decoder. Refuses a header announcing
    more than `max_bytes` of KV."""

    def __init__(
        self, *, max_bytes: int = DEFAULT_MAX_BYTES, staging: StagingBuffers | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.received_bytes = 0
        self.staging = staging
        # Everything after the header as it comes off the wire, records and payloads (from
        # `staging` when given): the blocks are views of its payloads. `release_area` gives it
        # back to `staging`.
        self.area: torch.Tensor | None = None
        self._records: list[int] = []  # each block's record offset in the area
        self._meta: dict | None = None
        self._blocks: list[KVBlock] = []
        self._buf: bytearray | memoryview = bytearray(_PREFIX.size)
        self._filled = 0
        self._stage = "prefix"  # prefix, header, blocks, done, failed
        self._expected_crc = 0

    @property
    def done(self) -> bool:
        return self._stage == "done"

    @property
    def extra(self) -> dict | None:
        """The sender's `extra` (`encode`), once the header has arrived."""
        return None if self._meta is None else self._meta.get("extra")

    @property
    def header(self) -> dict | None:
        """The header's metadata (checked), once it has arrived: the handoff's fields but its
        blocks, `block_num_tokens` and `block_nbytes`."""
        return self._meta

    @property
    def verified_blocks(self) -> list[KVBlock]:
        """The blocks that have passed their checksum so far, in order (views of the area)."""
        return self._blocks

    def writable(self) -> memoryview:
        """Where the next bytes of the stream go (empty once done): a socket can receive
        into it directly, then `wrote(n)`. After the header it is the rest of the area."""
        if self._stage == "failed":
            raise KVLinkError("The KV transfer already failed; start a new decoder.")
        return memoryview(self._buf)[self._filled :]

    def wrote(self, num_bytes: int) -> None:
        """`num_bytes` were written at the start of `writable()`: verify what they complete.
        Raises KVChecksumError or KVLinkError."""
        self._filled += num_bytes
        self.received_bytes += num_bytes
        try:
            if self._stage == "blocks":
                self._verify_blocks()
            # (a loop: an empty header is complete, and checked, as soon as its prefix is)
            while self._stage in ("prefix", "header") and self._filled == len(self._buf):
                self._advance()
        except KVLinkError:
            self._stage = "failed"
            raise

    def feed(self, data: bytes | bytearray | memoryview) -> int:
        """Take bytes; returns how many were used (fewer than given once the handoff is
        complete). Raises KVChecksumError or KVLinkError."""
        with memoryview(data) as outer, outer.cast("B") as view:  # released even on errors
            pos = 0
            while pos < len(view):
                with self.writable() as target:
                    take = min(len(view) - pos, len(target))
                    if take == 0:
                        break
                    target[:take] = view[pos : pos + take]
                pos += take
                self.wrote(take)
            return pos

    def result(self) -> KVHandoff:
        """The verified handoff; raises KVLinkCut when the stream is incomplete."""
        if not self.done:
            raise KVLinkCut(self.received_bytes, self._where())
        meta = self._meta
        assert meta is not None
        state = meta["generator_state"]
        return KVHandoff(
            request_id=meta["request_id"],
            model_fingerprint=meta["model_fingerprint"],
            block_size=meta["block_size"],
            kv_dtype=meta["kv_dtype"],
            num_layers=meta["num_layers"],
            num_kv_heads=meta["num_kv_heads"],
            head_dim=meta["head_dim"],
            token_ids=tuple(meta["token_ids"]),
            num_prompt_tokens=meta["num_prompt_tokens"],
            num_computed_tokens=meta["num_computed_tokens"],
            blocks=tuple(self._blocks),
            generator_state=None if state is None else base64.b64decode(state),
            generator_device=meta["generator_device"],
            num_emitted_chars=meta["num_emitted_chars"],
        )

    def _where(self) -> str:
        if self._stage in ("prefix", "header"):
            return "the header"
        return f"block {len(self._blocks)}"

    def release_area(self) -> None:
        """Give the area to `staging` for the next transfer: only once nothing reads the
        handoff's blocks any more (installed, or dropped)."""
        if self.area is not None and self.staging is not None:
            self.staging.give(self.area)
        self.area = None
        if self._stage == "blocks":
            self._stage = "failed"  # its bytes would land in a buffer it no longer owns

    def _advance(self) -> None:
        if self._stage == "prefix":
            magic, length, self._expected_crc = _PREFIX.unpack(self._buf)
            if magic != MAGIC:
                raise KVLinkError("The stream is not a KV handoff (bad magic bytes).")
            if length > MAX_HEADER_BYTES:
                raise KVChecksumError(None)  # a corrupted length: the header cannot be trusted
            self._stage, self._buf, self._filled = "header", bytearray(length), 0
        elif self._stage == "header":
            if crc32c.crc32c(self._buf) != self._expected_crc:
                raise KVChecksumError(None)
            self._meta = _check_meta(self._buf, self.max_bytes)
            sizes = self._meta["block_nbytes"]
            self._records = [0, *itertools.accumulate(_RECORD.size + n for n in sizes)]
            take = self.staging.take if self.staging is not None else _fresh
            self.area = take(self._records[-1])
            self._stage, self._filled = "blocks", 0
            self._buf = memoryview(self.area.numpy())
            self._verify_blocks()  # a handoff of no blocks is complete here

    def _verify_blocks(self) -> None:
        """Check every block the bytes so far complete, in order; done after the last."""
        meta, area = self._meta, self._buf
        assert meta is not None and self.area is not None
        while (j := len(self._blocks)) < len(meta["block_nbytes"]):
            start, end = self._records[j], self._records[j + 1]
            if end > self._filled:
                return
            index, expected_crc = _RECORD.unpack_from(area, start)
            payload = area[start + _RECORD.size : end]
            crc = crc32c.crc32c(payload, crc32c.crc32c(struct.pack("<I", index)))
            if crc != expected_crc or index != j:
                raise KVChecksumError(j)
            self._blocks.append(_block(meta, j, self.area[start + _RECORD.size : end]))
        self._stage, self._buf, self._filled = "done", bytearray(), 0


def _check_meta(header: bytearray, max_bytes: int) -> dict:
    """The header's metadata, after checking it describes a handoff this module can rebuild."""
    try:
        meta = json.loads(header)
        assert isinstance(meta, dict) and meta["version"] == VERSION
        assert meta["byteorder"] == sys.byteorder and meta["kv_dtype"] in KV_STORAGE
        for name in ("request_id", "model_fingerprint", "generator_device"):
            assert isinstance(meta[name], str)
        assert meta["generator_state"] is None or isinstance(meta["generator_state"], str)
        positive = ("block_size", "num_layers", "num_kv_heads", "head_dim", "num_computed_tokens")
        counts = ("num_prompt_tokens", "num_emitted_chars", *positive)
        assert all(type(meta[name]) is int and meta[name] >= 0 for name in counts)
        assert all(meta[name] > 0 for name in positive)
        assert all(type(t) is int for t in meta["token_ids"])
        bs, n = meta["block_size"], meta["num_computed_tokens"]
        counts, sizes = meta["block_num_tokens"], meta["block_nbytes"]
        assert counts == [min(bs, n - i) for i in range(0, n, bs)] and len(sizes) == len(counts)
        assert all(s == _block_nbytes(meta, c) for s, c in zip(sizes, counts, strict=True))
        assert sum(sizes) <= max_bytes
        return meta
    except (AssertionError, KeyError, TypeError, ValueError):  # ValueError: bad JSON or UTF-8
        raise KVLinkError(
            "The KV transfer's header is not a version-1 handoff this host can read."
        ) from None


def _block_nbytes(meta: dict, num_tokens: int) -> int:
    storage = KV_STORAGE[meta["kv_dtype"]]
    rows = meta["num_layers"] * 2 * meta["num_kv_heads"] * num_tokens
    scales = 4 * rows if storage in (torch.int8, torch.float8_e4m3fn) else 0
    return rows * meta["head_dim"] * storage.itemsize + scales


def _fresh(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _block(meta: dict, index: int, payload: torch.Tensor) -> KVBlock:
    """Block `index`'s tensors over its verified payload (uint8; no copy)."""
    storage = KV_STORAGE[meta["kv_dtype"]]
    num_tokens = meta["block_num_tokens"][index]
    rows = (meta["num_layers"], 2 * meta["num_kv_heads"], num_tokens)
    kv_bytes = rows[0] * rows[1] * num_tokens * meta["head_dim"] * storage.itemsize
    kv = _as(payload[:kv_bytes], storage).view(*rows, meta["head_dim"])
    if kv_bytes == payload.numel():
        return KVBlock(kv)
    return KVBlock(kv, _as(payload[kv_bytes:], torch.float32).view(rows))


def _as(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bytes as `dtype`: a view where the offset is aligned for it, else a copy."""
    if data.storage_offset() % dtype.itemsize == 0:
        return data.view(dtype)
    return data.clone().view(dtype)


def decode(chunks: Iterable[bytes | bytearray | memoryview]) -> KVHandoff:
    """The handoff `chunks` encode; raises KVChecksumError, KVLinkCut, or KVLinkError (also for
    bytes past the end)."""
    decoder = HandoffDecoder()
    for chunk in chunks:
        if decoder.feed(chunk) < len(memoryview(chunk).cast("B")):
            raise KVLinkError("The KV transfer has bytes past the end of the handoff.")
    return decoder.result()


# -- shared memory ------------------------------------------------------------------------------
def write_shm(handoff: KVHandoff) -> str:
    """Write `handoff`'s frames into a new shared-memory segment; returns its name. The reader
    owns the segment (`read_shm` unlinks it); a failed write unlinks it here."""
    size = encoded_size(handoff)
    shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        offset = 0
        for chunk in encode(handoff):
            n = len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
            shm.buf[offset : offset + n] = chunk
            offset += n
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    name = shm.name
    shm.close()
    # The reader unlinks it, maybe in another process: this one must not at its exit.
    resource_tracker.unregister(shm._name, "shared_memory")  # the name it was tracked by
    return name


def read_shm(name: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> KVHandoff:
    """The verified handoff in segment `name`, which is unlinked whatever happens; raises like
    `decode` (bytes past the end are the segment's page padding and are ignored)."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        decoder = HandoffDecoder(max_bytes=max_bytes)
        with shm.buf[:] as view:
            decoder.feed(view)
        return decoder.result()
    finally:
        shm.close()
        shm.unlink()
