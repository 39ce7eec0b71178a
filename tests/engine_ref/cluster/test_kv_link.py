"""`engine_ref.cluster.kv_link`: a block record by hand (CRC-32C from an independent bitwise
implementation), round trips of every KV dtype in any chunking, a flipped bit anywhere caught
and named by block as soon as that block arrives, cuts at every kind of offset, and the two
transports: P/D over TCP loopback and shared memory gives the single engine's tokens and
logprobs, a corrupt or cut transfer never reaches the receiver's callback (decode never starts:
install and `engine.step` are spied), the decode engine allocates nothing for it, and a shared
memory segment is unlinked after every read, good or bad."""

from __future__ import annotations

import asyncio
import json
import struct
from multiprocessing import shared_memory

import pytest
import torch
from pd_util import (
    GREEDY,
    SEEDED,
    Generation,
    assert_idle,
    make,
    prefill,
    prompt_of,
    run_single,
    run_to_end,
)

from engine_ref.cluster import kv_link, kv_tcp
from engine_ref.cluster.kv_link import (
    HandoffDecoder,
    KVChecksumError,
    KVLinkCut,
    KVLinkError,
    KVTransferRejected,
)
from engine_ref.cluster.kv_tcp import KVReceiver
from engine_ref.core import kv_handoff
from engine_ref.core.kv_handoff import HandoffExporter, KVBlock, KVHandoff, NoFreeBlocks


def crc32c_bitwise(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), one bit at a time."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_check_value():
    assert crc32c_bitwise(b"123456789") == 0xE3069283  # the catalogued check value


def test_a_handoff_framed_by_hand():
    # 1 layer, 1 KV head, head_dim 2, blocks of 2 tokens, 3 tokens with KV: blocks of 2 and 1.
    kv = torch.arange(1.0, 13.0).view(1, 2, 3, 2)  # [L, 2 * kvh, tokens, hd]: K then V
    handoff = KVHandoff(
        request_id="r", model_fingerprint="m", block_size=2, kv_dtype="float32",
        num_layers=1, num_kv_heads=1, head_dim=2, token_ids=(7, 8, 9, 10),
        num_prompt_tokens=3, num_computed_tokens=3,
        blocks=(KVBlock(kv[:, :, :2].contiguous()), KVBlock(kv[:, :, 2:].contiguous())),
    )  # fmt: skip
    stream = b"".join(bytes(chunk) for chunk in kv_link.encode(handoff))
    magic, length, header_crc = struct.unpack_from("<4sII", stream)
    header = stream[12 : 12 + length]
    assert magic == b"KVH1" and header_crc == crc32c_bitwise(header)
    meta = json.loads(header)
    assert meta["block_num_tokens"] == [2, 1] and meta["block_nbytes"] == [32, 16]
    assert meta["token_ids"] == [7, 8, 9, 10] and meta["generator_state"] is None
    at = 12 + length
    # Block 0: K of tokens 0-1 (1, 2, 3, 4), V of tokens 0-1 (7, 8, 9, 10).
    payload0 = struct.pack("<8f", 1, 2, 3, 4, 7, 8, 9, 10)
    index0 = struct.pack("<I", 0)
    assert stream[at : at + 8] == index0 + struct.pack("<I", crc32c_bitwise(index0 + payload0))
    assert stream[at + 8 : at + 40] == payload0
    at += 40
    payload1 = struct.pack("<4f", 5, 6, 11, 12)
    index1 = struct.pack("<I", 1)
    assert stream[at : at + 8] == index1 + struct.pack("<I", crc32c_bitwise(index1 + payload1))
    assert stream[at + 8 :] == payload1
    assert kv_link.encoded_size(handoff) == len(stream)
    decoded = kv_link.decode([stream])
    assert torch.equal(torch.cat([b.kv for b in decoded.blocks], dim=2), kv)


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(single, A, B): float32, block size 16; each test leaves them idle."""
    return make(tiny_model), make(tiny_model), make(tiny_model)


@pytest.fixture(scope="module")
def three_blocks(engines) -> tuple[KVHandoff, bytes]:
    """A 40-token prompt's handoff (blocks of 16, 16, 8 tokens) and its encoding."""
    _, a, _ = engines
    exporter = HandoffExporter(a)
    _, handoff = prefill(exporter, "three", prompt_of(40), GREEDY)
    exporter.release("three")
    return handoff, b"".join(bytes(chunk) for chunk in kv_link.encode(handoff))


def _offsets(handoff: KVHandoff, stream: bytes) -> dict[str, int]:
    """Where each frame starts: "header" (its JSON), "block i" (its record)."""
    (length,) = struct.unpack_from("<I", stream, 4)
    at = {"header": 12}
    offset = 12 + length
    for i, size in enumerate(json.loads(stream[12 : 12 + length])["block_nbytes"]):
        at[f"block {i}"] = offset
        offset += 8 + size
    at["end"] = offset
    return at


def _same(x: KVHandoff, y: KVHandoff) -> bool:
    def raw(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    fields = [f for f in x.__dataclass_fields__ if f != "blocks"]
    return all(getattr(x, f) == getattr(y, f) for f in fields) and all(
        torch.equal(raw(p.kv), raw(q.kv))
        and (p.scales is None and q.scales is None or torch.equal(p.scales, q.scales))
        for p, q in zip(x.blocks, y.blocks, strict=True)
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bf16", "int8", "fp8_e4m3"])
def test_a_round_trip_in_any_chunking_keeps_every_bit(tiny_model, kv_cache_dtype):
    engine = make(tiny_model, kv_cache_dtype=kv_cache_dtype)
    exporter = HandoffExporter(engine)
    params = GREEDY if kv_cache_dtype != "auto" else SEEDED  # with a generator state
    _, handoff = prefill(exporter, "r", prompt_of(21), params)
    exporter.release("r")
    stream = b"".join(bytes(chunk) for chunk in kv_link.encode(handoff))
    assert _same(kv_link.decode([stream]), handoff)
    decoder = HandoffDecoder()
    for i in range(0, len(stream), 7):
        assert decoder.feed(stream[i : i + 7]) == len(stream[i : i + 7])
    assert _same(decoder.result(), handoff)
    assert_idle(engine)


FLIPS = [("header", 0, None), ("header", 30, None)] + [
    (f"block {i}", offset, i) for i in range(3) for offset in (0, 4, 8, 100, -1)
]  # in a block: its index field, its checksum field, the payload's first, 93rd, last byte


@pytest.mark.parametrize(("frame", "offset", "block_index"), FLIPS)
def test_a_flipped_bit_is_caught_and_names_its_block(three_blocks, frame, offset, block_index):
    handoff, stream = three_blocks
    at = _offsets(handoff, stream)
    end = at[f"block {block_index + 1}" if block_index in (0, 1) else "end"]
    position = (end + offset) if offset < 0 else at[frame] + offset
    corrupt = bytearray(stream)
    corrupt[position] ^= 0x10
    # Caught when the bad block's last byte arrives, before any later byte is needed.
    decoder = HandoffDecoder()
    with pytest.raises(KVChecksumError) as caught:
        decoder.feed(corrupt[: end if frame != "header" else at["block 0"]])
    assert caught.value.block_index == block_index
    where = "header" if block_index is None else f"block {block_index}"
    assert str(caught.value) == f"The KV transfer's {where} failed its CRC-32C checksum."
    with pytest.raises(KVLinkError, match="already failed"):
        decoder.feed(b"x")


@pytest.mark.parametrize(
    ("frame", "offset", "where"),
    [
        ("header", -7, "the header"),  # inside the fixed prefix
        ("header", 25, "the header"),  # inside the JSON
        ("block 0", 0, "block 0"),  # header done, no block yet
        ("block 1", 0, "block 1"),  # between blocks
        ("block 1", 5, "block 1"),  # inside a record's index and checksum
        ("block 2", 200, "block 2"),  # inside a payload
        ("end", -1, "block 2"),  # one byte short
    ],
)
def test_a_cut_stream_is_kvlinkcut(three_blocks, frame, offset, where):
    handoff, stream = three_blocks
    cut = _offsets(handoff, stream)[frame] + offset
    with pytest.raises(KVLinkCut) as caught:
        kv_link.decode([stream[:cut]])
    assert (
        str(caught.value) == f"The KV transfer ended after {cut} bytes, in the middle of {where}."
    )


def test_bytes_that_are_not_a_handoff(three_blocks):
    _, stream = three_blocks
    with pytest.raises(KVLinkError, match=r"^The KV transfer has bytes past the end"):
        kv_link.decode([stream + b"\0"])
    with pytest.raises(KVLinkError, match=r"^The stream is not a KV handoff \(bad magic"):
        kv_link.decode([b"GET / HTTP/1.1\r\n\r\n"])


# -- transports ---------------------------------------------------------------------------------
class DecodeWorker:
    """Engine B behind a receiver: its callback installs each verified handoff and decodes it
    to the end. Spies: the handoffs the callback got, and every entry into `engine.step`."""

    def __init__(self, engine, monkeypatch):
        self.engine = engine
        self.installs, self.steps, self.errors = [], 0, []
        self.generations: dict[str, Generation] = {}
        step = engine.step

        def counting_step():
            self.steps += 1
            return step()

        monkeypatch.setattr(engine, "step", counting_step)

    def on_handoff(self, handoff: KVHandoff) -> None:
        self.installs.append(handoff.request_id)
        kv_handoff.install(self.engine, handoff.request_id, handoff, GREEDY)
        run_to_end(self.engine, self.generations.setdefault(handoff.request_id, Generation()))


async def _send_raw(port: int, data: bytes) -> dict:
    """Write `data` and half-close (a sender that stops), then read the receiver's reply."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        writer.write_eof()
        return json.loads(await reader.read())
    finally:
        writer.close()
        await writer.wait_closed()


def _over_tcp(worker: DecodeWorker, handoff: KVHandoff) -> None:
    async def go():
        async with KVReceiver(worker.on_handoff, on_error=worker.errors.append) as receiver:
            await kv_tcp.send_handoff("127.0.0.1", receiver.port, handoff, timeout_s=10)

    asyncio.run(go())


def _over_shm(worker: DecodeWorker, handoff: KVHandoff) -> None:
    name = kv_link.write_shm(handoff)
    worker.on_handoff(kv_link.read_shm(name))
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)  # unlinked by the read


@pytest.mark.parametrize("length", [15, 16, 17, 1, 100])
@pytest.mark.parametrize("transport", [_over_tcp, _over_shm], ids=["tcp", "shm"])
def test_pd_over_a_transport_equals_the_single_engine(engines, monkeypatch, transport, length):
    single, a, b = engines
    prompt = prompt_of(length)
    expected = run_single(single, prompt, GREEDY)
    exporter = HandoffExporter(a)
    first, handoff = prefill(exporter, "r", prompt, GREEDY)
    worker = DecodeWorker(b, monkeypatch)
    worker.generations["r"] = first
    transport(worker, handoff)
    exporter.release("r")
    got = worker.generations["r"]
    assert (got.tokens, got.logprobs) == (expected.tokens, expected.logprobs)
    assert worker.errors == []
    assert_idle(single, a, b)


def _no_trace_on(worker: DecodeWorker) -> None:
    """Decode never started: no install, no step, no request, no block taken."""
    engine = worker.engine
    assert worker.installs == [] and worker.steps == 0
    assert engine.requests == {} and engine.scheduler.running == []
    assert engine.stats().num_blocks_free == engine.stats().num_blocks_total


@pytest.mark.parametrize("block_index", [0, 1, 2])
def test_over_tcp_decode_never_starts_on_a_block_that_failed(
    engines, three_blocks, monkeypatch, block_index
):
    _, _, b = engines
    handoff, stream = three_blocks
    corrupt = bytearray(stream)
    corrupt[_offsets(handoff, stream)[f"block {block_index}"] + 20] ^= 0x01
    worker = DecodeWorker(b, monkeypatch)

    async def go():
        async with KVReceiver(worker.on_handoff, on_error=worker.errors.append) as receiver:
            reply = await _send_raw(receiver.port, bytes(corrupt))
            assert reply == {
                "ok": False,
                "kind": "KVChecksumError",
                "error": f"The KV transfer's block {block_index} failed its CRC-32C checksum.",
            }
            _no_trace_on(worker)
            # The same receiver then takes the intact handoff, installs and decodes it.
            await kv_tcp.send_handoff("127.0.0.1", receiver.port, handoff, timeout_s=10)

    asyncio.run(go())
    (error,) = worker.errors
    assert isinstance(error, KVChecksumError) and error.block_index == block_index
    assert worker.installs == ["three"] and worker.steps > 0
    assert len(worker.generations["three"].tokens) == GREEDY.max_tokens - 1
    assert_idle(b)


@pytest.mark.parametrize(("frame", "offset"), [("header", 10), ("block 1", 0), ("block 2", 99)])
def test_over_tcp_a_cut_transfer_never_reaches_the_callback(
    engines, three_blocks, monkeypatch, frame, offset
):
    _, _, b = engines
    handoff, stream = three_blocks
    cut = _offsets(handoff, stream)[frame] + offset
    worker = DecodeWorker(b, monkeypatch)

    async def go():
        async with KVReceiver(worker.on_handoff, on_error=worker.errors.append) as receiver:
            return await _send_raw(receiver.port, stream[:cut])

    reply = asyncio.run(go())
    assert (reply["ok"], reply["kind"]) == (False, "KVLinkCut")
    (error,) = worker.errors
    assert isinstance(error, KVLinkCut) and error.received_bytes == cut
    _no_trace_on(worker)


def test_over_tcp_the_sender_learns_why_an_install_failed(tiny_model, three_blocks, monkeypatch):
    handoff, _ = three_blocks
    worker = DecodeWorker(make(tiny_model, num_blocks=4), monkeypatch)
    worker.engine.add_request("occupant", prompt_of(20), GREEDY)
    worker.engine.step()  # holds 2 blocks: 2 free, 3 needed
    worker.steps = 0

    async def go():
        async with KVReceiver(worker.on_handoff) as receiver:
            await kv_tcp.send_handoff("127.0.0.1", receiver.port, handoff, timeout_s=10)

    with pytest.raises(KVTransferRejected) as caught:
        asyncio.run(go())
    assert caught.value.kind == "NoFreeBlocks"
    assert caught.value.reason == str(NoFreeBlocks(3, 2))
    assert worker.steps == 0 and list(worker.engine.requests) == ["occupant"]
    worker.engine.abort("occupant")
    worker.engine.step()
    assert_idle(worker.engine)


def test_over_tcp_the_sender_learns_a_block_failed(engines, three_blocks, monkeypatch):
    """The receiver reads the rest of a stream whose block failed, so its reply arrives."""
    _, _, b = engines
    handoff, _ = three_blocks
    encode = kv_link.encode

    def corrupting_encode(h):
        for i, chunk in enumerate(encode(h)):  # header, then record and payload per block
            yield bytes([chunk[0] ^ 1]) + bytes(chunk[1:]) if i == 4 else chunk

    monkeypatch.setattr(kv_tcp, "encode", corrupting_encode)
    worker = DecodeWorker(b, monkeypatch)

    async def go():
        async with KVReceiver(worker.on_handoff) as receiver:
            await kv_tcp.send_handoff("127.0.0.1", receiver.port, handoff, timeout_s=10)

    with pytest.raises(KVTransferRejected) as caught:
        asyncio.run(go())
    assert caught.value.kind == "KVChecksumError"
    assert caught.value.reason == "The KV transfer's block 1 failed its CRC-32C checksum."
    _no_trace_on(worker)


def _segment_with(data: bytes) -> str:
    shm = shared_memory.SharedMemory(create=True, size=len(data))
    shm.buf[: len(data)] = data
    name = shm.name
    shm.close()
    return name


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_shm_a_bad_segment_raises_and_is_unlinked(three_blocks, damage):
    handoff, stream = three_blocks
    data = bytearray(stream)
    at = _offsets(handoff, stream)["block 1"]
    if damage == "flip":
        data[at + 50] ^= 0x80
    else:
        data = data[: at + 50]
    name = _segment_with(bytes(data))
    error = KVChecksumError if damage == "flip" else KVLinkCut
    with pytest.raises(error, match="block 1"):
        kv_link.read_shm(name)
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)
