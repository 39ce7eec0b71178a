"""`kv_tcp.KVReceiver` reads the socket straight into the decoder's area: a stream in any
pieces over real TCP decodes bit for bit; the blocks the callback gets are views of the staging
buffer the socket filled, given back after the callback and reused, still bit for bit, by the
next transfer; a transfer that goes quiet fails after `timeout_s` with a reply, one the sender
resets fails without one; neither reaches the callback, and each gives its buffer back."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from types import SimpleNamespace

import crc32c
import pytest
import torch
from pd_util import GREEDY, make, prefill, prompt_of

from engine_ref.cluster import kv_link, kv_tcp
from engine_ref.cluster.kv_link import KVLinkCut, KVLinkError, StagingBuffers
from engine_ref.cluster.kv_tcp import KVReceiver, send_handoff
from engine_ref.core.kv_handoff import HandoffExporter, KVHandoff


@pytest.fixture(scope="module")
def handoff(tiny_model) -> KVHandoff:
    """A 40-token prompt's handoff (blocks of 16, 16, 8 tokens)."""
    exporter = HandoffExporter(make(tiny_model))
    _, handoff = prefill(exporter, "r", prompt_of(40), GREEDY)
    exporter.release("r")
    return handoff


def _stream(handoff: KVHandoff) -> bytes:
    return b"".join(bytes(chunk) for chunk in kv_link.encode(handoff))


def _block_1(stream: bytes) -> int:
    """Where block 1's record starts."""
    (length,) = struct.unpack_from("<I", stream, 4)
    sizes = json.loads(stream[12 : 12 + length])["block_nbytes"]
    return 12 + length + 8 + sizes[0]


class Spy:
    """A receiver's callback and error sink; keeps copies of what it got and where it lay."""

    def __init__(self) -> None:
        self.handoffs: list[KVHandoff] = []
        self.pointers: list[list[int]] = []
        self.errors: list[Exception] = []

    def on_handoff(self, handoff: KVHandoff) -> None:
        self.pointers.append([b.kv.data_ptr() for b in handoff.blocks])
        blocks = tuple(type(b)(b.kv.clone(), b.scales) for b in handoff.blocks)
        self.handoffs.append(KVHandoff(**{**handoff.__dict__, "blocks": blocks}))


def _equal(x: KVHandoff, y: KVHandoff) -> bool:
    return x.token_ids == y.token_ids and all(
        torch.equal(p.kv, q.kv) for p, q in zip(x.blocks, y.blocks, strict=True)
    )


async def _send_pieces(port: int, data: bytes, cuts: list[int]) -> dict:
    """`data` cut at `cuts`, each piece its own write with a pause between (so the receiver
    reads them apart), then a half-close and the reply."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
            writer.write(data[start:end])
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write_eof()
        return json.loads(await asyncio.wait_for(reader.read(), 10))
    finally:
        writer.close()


def test_a_stream_in_any_pieces_decodes_bit_for_bit(handoff):
    stream = _stream(handoff)
    at = _block_1(stream)
    piecings = [[1], [5, 12, 13], [at - 1, at, at + 3], [len(stream) - 1], list(range(1, 40))]
    spy = Spy()

    async def go():
        async with KVReceiver(spy.on_handoff, on_error=spy.errors.append) as receiver:
            return [await _send_pieces(receiver.port, stream, cuts) for cuts in piecings]

    assert asyncio.run(go()) == [{"ok": True}] * len(piecings)
    assert spy.errors == [] and len(spy.handoffs) == len(piecings)
    assert all(_equal(got, handoff) for got in spy.handoffs)


def test_blocks_are_views_of_the_staging_buffer_reused_next_time(handoff, tiny_model):
    exporter = HandoffExporter(make(tiny_model))
    _, other = prefill(exporter, "other", prompt_of(40, seed=1), GREEDY)  # other KV, same size
    exporter.release("other")
    staging, spy = StagingBuffers(), Spy()

    async def go():
        async with KVReceiver(spy.on_handoff, staging=staging) as receiver:
            for sent in (handoff, other):
                await send_handoff("127.0.0.1", receiver.port, sent, timeout_s=10)

    asyncio.run(go())
    assert _equal(spy.handoffs[0], handoff) and _equal(spy.handoffs[1], other)
    assert spy.pointers[0] == spy.pointers[1]  # the second landed in the first's buffer
    (kept,) = staging._idle  # given back after the callback
    lo, hi = kept.data_ptr(), kept.data_ptr() + kept.numel()
    assert all(lo <= p < hi for p in spy.pointers[0])


def test_a_quiet_sender_is_failed_after_the_timeout_with_a_reply(handoff):
    stream = _stream(handoff)
    staging, spy = StagingBuffers(), Spy()

    async def go():
        async with KVReceiver(
            spy.on_handoff, on_error=spy.errors.append, timeout_s=0.3, staging=staging
        ) as receiver:
            reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
            writer.write(stream[: _block_1(stream) + 50])  # then nothing, connection open
            await writer.drain()
            try:
                return json.loads(await asyncio.wait_for(reader.readline(), 5))
            finally:
                writer.close()

    reply = asyncio.run(go())
    message = "The KV transfer stalled for more than 0.3 s."
    assert reply == {"ok": False, "kind": "KVLinkError", "error": message}
    (error,) = spy.errors
    assert type(error) is KVLinkError and str(error) == message
    assert spy.handoffs == [] and len(staging._idle) == 1  # its buffer given back


def test_a_sender_reset_mid_block_is_a_cut_without_a_reply(handoff):
    stream = _stream(handoff)
    cut = _block_1(stream) + 50
    staging, spy = StagingBuffers(), Spy()

    async def go():
        async with KVReceiver(spy.on_handoff, on_error=spy.errors.append, staging=staging) as r:
            with socket.create_connection(("127.0.0.1", r.port)) as sock:
                sock.sendall(stream[:cut])
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            for _ in range(200):  # the reset reaches the receiver
                if spy.errors:
                    break
                await asyncio.sleep(0.01)

    asyncio.run(go())
    (error,) = spy.errors
    assert isinstance(error, KVLinkCut) and error.received_bytes == cut
    assert "in the middle of block 1" in str(error)
    assert spy.handoffs == [] and len(staging._idle) == 1


@pytest.mark.parametrize(
    ("crc", "kind", "message"),
    [
        (1, "KVChecksumError", "The KV transfer's header failed its CRC-32C checksum."),
        (crc32c.crc32c(b""), "KVLinkError", "header is not a version-1 handoff"),  # 0
    ],
)
def test_an_empty_header_is_refused_not_waited_for(crc, kind, message):
    """A prefix announcing a header of 0 bytes: checked at once (its checksum, then its
    JSON), in memory and over TCP, where the reply says why."""
    stream = struct.pack("<4sII", b"KVH1", 0, crc)
    with pytest.raises(KVLinkError, match=message.replace("(", r"\(")):
        kv_link.decode([stream])
    spy = Spy()

    async def go():
        async with KVReceiver(spy.on_handoff, on_error=spy.errors.append) as receiver:
            return await _send_pieces(receiver.port, stream, [])

    reply = asyncio.run(go())
    assert reply["ok"] is False and reply["kind"] == kind and message in reply["error"]
    assert spy.handoffs == [] and len(spy.errors) == 1


@pytest.mark.parametrize(("verified", "batch"), [(0, 4), (5, 4), (6, 1), (9, 1), (10, 1)])
def test_the_last_land_batch_blocks_land_as_each_is_verified(monkeypatch, verified, batch):
    """Blocks land LAND_BATCH at a time while more than LAND_BATCH are still to come, then one
    at a time, so the install after the last byte copies at most one block (it copied up to
    16, 0.6-1.0 ms of a 2,048-token SmolLM2 transfer). 10 blocks, LAND_BATCH 4: at 6 verified
    (4 to come) the batch is 1."""
    monkeypatch.setattr(kv_tcp, "LAND_BATCH", 4)
    transfer = kv_tcp._Transfer.__new__(kv_tcp._Transfer)
    transfer.decoder = SimpleNamespace(header={"block_nbytes": [8] * 10},
                                       verified_blocks=[None] * verified)  # fmt: skip
    assert transfer._batch() == batch
