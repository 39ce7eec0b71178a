"""What the KV link (`engine_ref.cluster.kv_link`) moves per second: a SmolLM2-shaped handoff
(30 layers, 3 KV heads, head_dim 64; random K/V, blocks of 16) of 2,048 tokens, encoded and
decoded with every block's CRC-32C checked, in memory, over TCP loopback and through shared
memory; beside it, in the same run, a plain copy of the same bytes and CRC-32C alone (the
floors), all on one thread. MB/s count the K/V bytes (1 MB = 10^6 bytes); medians over rounds.

    python benchmarks/kv_link_throughput.py
    python benchmarks/kv_link_throughput.py --tokens 8192 --dtypes bfloat16 int8 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import crc32c
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ref.cluster import kv_link, kv_tcp  # noqa: E402
from engine_ref.core.kv_handoff import KV_STORAGE, KVBlock, KVHandoff  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16


def smollm2_handoff(num_tokens: int, kv_dtype: str) -> KVHandoff:
    gen = torch.Generator().manual_seed(0)
    storage = KV_STORAGE[kv_dtype]
    scaled = storage in (torch.int8, torch.float8_e4m3fn)
    blocks = []
    for start in range(0, num_tokens, BLOCK_SIZE):
        n = min(BLOCK_SIZE, num_tokens - start)
        x = torch.randn((LAYERS, 2 * KV_HEADS, n, HEAD_DIM), generator=gen)
        if scaled:
            blocks.append(KVBlock((x * 40).clamp(-127, 127).to(storage), torch.rand(x.shape[:-1])))
        else:
            blocks.append(KVBlock(x.to(storage)))
    return KVHandoff(
        request_id="bench", model_fingerprint="smollm2-shaped", block_size=BLOCK_SIZE,
        kv_dtype=kv_dtype, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        token_ids=tuple(range(num_tokens + 1)), num_prompt_tokens=num_tokens,
        num_computed_tokens=num_tokens, blocks=tuple(blocks),
    )  # fmt: skip


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def in_memory(handoff: KVHandoff) -> None:
    decoder = kv_link.HandoffDecoder()
    for chunk in kv_link.encode(handoff):
        decoder.feed(chunk)
    decoder.result()


def over_tcp(handoff: KVHandoff) -> None:
    async def go() -> None:
        async with kv_tcp.KVReceiver(lambda h: None) as receiver:
            await kv_tcp.send_handoff("127.0.0.1", receiver.port, handoff)

    asyncio.run(go())


def over_shm(handoff: KVHandoff) -> None:
    kv_link.read_shm(kv_link.write_shm(handoff))


def copy_floor(handoff: KVHandoff) -> None:
    for block in handoff.blocks:
        block.kv.clone()


def crc_floor(handoff: KVHandoff) -> None:
    for block in handoff.blocks:
        crc32c.crc32c(memoryview(block.kv.view(torch.uint8).reshape(-1).numpy()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the link runs on one thread; so does the floor copy
    paths = {"copy (floor)": copy_floor, "crc32c only": crc_floor, "encode+decode": in_memory,
             "tcp loopback": over_tcp, "shared memory": over_shm}  # fmt: skip
    for kv_dtype in args.dtypes:
        handoff = smollm2_handoff(args.tokens, kv_dtype)
        kv_bytes = handoff.kv_nbytes
        wire = kv_link.encoded_size(handoff)
        print(
            f"{kv_dtype}: {args.tokens} tokens, {len(handoff.blocks)} blocks, "
            f"M_KV {kv_bytes // args.tokens} B/token ({kv_bytes / 1e6:.1f} MB), "
            f"{wire / args.tokens:.0f} B/token on the wire"
        )
        for name, fn in paths.items():
            fn(handoff)  # warm-up
            runs = [timed(lambda fn=fn, h=handoff: fn(h)) for _ in range(args.rounds)]
            seconds = statistics.median(runs)
            print(f"  {name:14s} {kv_bytes / seconds / 1e6:8.0f} MB/s  ({seconds * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
