"""Resident memory of the reference server around hostile clients, read from /proc/<pid>/status
(VmRSS) of a `python -m engine_ref.serving` subprocess launched by `harness.managed`.

Two measurements, as `tests/engine_ref/test_server_rss.py` and `test_server_fuzz.py` make them:
- slow readers: after a warm-up round of the same requests read normally (so the allocator's
  high-water mark is set), N streaming clients with a 4 KiB receive buffer read the response
  head and then nothing for S seconds, then hang up; RSS before, at its peak, and once idle.
- fuzz: seeded random malformed and extreme request bodies (wrong types, NaN/Infinity tokens,
  2**64, deep nesting, huge strings, unknown fields, non-JSON) sent alongside well-formed greedy
  streams; RSS before and once idle, and how many answers were 5xx (should be none).

    python benchmarks/server_rss.py --clients 20 --stall-s 30 --fuzz-bodies 600
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
import urllib.request
from pathlib import Path

import aiohttp
import click

from harness.targets.managed import ManagedServerConfig, managed_server

SERVER_ARGS = (
    "--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "64MiB",
    "--log-level", "warning", "--stream-write-timeout", "3", "--max-stream-backlog", "64",
)  # fmt: skip
EXTREMES = (
    0, -1, 2**31, 2**63, 2**64, -(2**63) - 1, 1e20, 5e-324, float("nan"), float("inf"),
    float("-inf"), "NaN", "Infinity", "", "a" * 100_000, [], {}, None, True, [[]], [0] * 5000,
)  # fmt: skip
FIELDS = (
    "model", "prompt", "messages", "max_tokens", "n", "temperature", "top_p", "top_k", "seed",
    "stop", "stop_token_ids", "logprobs", "top_logprobs", "priority", "stream",
    "stream_options", "cache_salt", "no_such_field",
)  # fmt: skip


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise SystemExit(f"no VmRSS for process {pid}")


def gauges(url: str) -> tuple[float, float, float]:
    """(running, waiting, KV blocks used) from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        name = line.split("{")[0]
        if name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_blocks_used",
        ):
            values[name] = float(line.rsplit(" ", 1)[1])
    return (
        values["vllm:num_requests_running"],
        values["vllm:num_requests_waiting"],
        values["vllm:kv_cache_blocks_used"],
    )


def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while gauges(url) != (0, 0, 0):
        if time.monotonic() > deadline:
            raise SystemExit(f"the server did not return to idle: {gauges(url)}")
        time.sleep(0.2)
    time.sleep(1.0)  # let freed memory settle


def stream_body(seed: int, max_tokens: int, n: int, logprobs: int) -> dict:
    body = {
        "prompt": list(range(10, 40)),
        "max_tokens": max_tokens,
        "n": n,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": seed,
        "stream": True,
    }
    if logprobs:
        body["logprobs"] = logprobs
    return body


async def read_streams(url: str, bodies: list[dict]) -> None:
    async def one(session: aiohttp.ClientSession, body: dict) -> None:
        async with session.post(url + "/v1/completions", json=body) as response:
            async for _ in response.content.iter_any():
                pass

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, body) for body in bodies))


def slow_readers(url: str, pid: int, *, clients: int, stall_s: float, **shape) -> dict:
    asyncio.run(read_streams(url, [stream_body(i, 1000, **shape) for i in range(clients)]))
    wait_idle(url)
    before = rss_kib(pid)
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for i in range(clients):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect((host, int(port)))
        data = json.dumps(stream_body(i, 4000, **shape)).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        sock.sendall(head.encode() + data)
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(4096)
        sockets.append(sock)
    peak = before
    t0_s = time.monotonic()
    while time.monotonic() - t0_s < stall_s:
        peak = max(peak, rss_kib(pid))
        time.sleep(1.0)
    for sock in sockets:
        sock.close()
    wait_idle(url)
    return {
        "before": before,
        "peak": peak,
        "after": rss_kib(pid),
        "note": f"{clients} clients, {stall_s:.0f} s",
    }


def fuzz_body(rng: random.Random) -> tuple[str, bytes]:
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    roll = rng.random()
    if roll < 0.1:
        depth = rng.choice([50, 5_000, 100_000])
        return path, b"[" * depth + b"]" * depth
    if roll < 0.2:
        return path, rng.choice(
            [b"", b"{", b"[1,2]", b"null", bytes(rng.randrange(256) for _ in range(32))]
        )
    body: dict = {"max_tokens": 4, "stream": rng.random() < 0.5}
    if path == "/v1/completions":
        body["prompt"] = "Hi"
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    for name in rng.sample(FIELDS, rng.randrange(6)):
        body[name] = rng.choice(EXTREMES)
    return path, json.dumps(body, allow_nan=True).encode()


async def fuzz_load(url: str, num_bodies: int, seed: int) -> dict:
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    done = asyncio.Event()

    async def send(session: aiohttp.ClientSession, path: str, raw: bytes) -> None:
        async with session.post(
            url + path, data=raw, headers={"Content-Type": "application/json"}
        ) as response:
            statuses[response.status] = statuses.get(response.status, 0) + 1
            if response.status == 200 and response.headers["Content-Type"].startswith(
                "text/event-stream"
            ):
                async for _ in response.content:
                    break  # drop the stream after its first line: the server must abort it
            else:
                await response.read()

    async def greedy(session: aiohttp.ClientSession) -> int:
        count = 0
        body = {
            "prompt": [5, 6, 7],
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        while not done.is_set():
            async with session.post(url + "/v1/completions", json=body) as response:
                await response.read()
            count += 1
        return count

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        streams = [asyncio.create_task(greedy(session)) for _ in range(3)]
        for start in range(0, num_bodies, 3):
            batch = [fuzz_body(rng) for _ in range(min(3, num_bodies - start))]
            await asyncio.gather(*(send(session, path, raw) for path, raw in batch))
        done.set()
        greedy_streams = sum(await asyncio.gather(*streams))
    return {"statuses": statuses, "greedy_streams": greedy_streams}


def fuzz(url: str, pid: int, *, num_bodies: int, seed: int) -> dict:
    wait_idle(url)
    before = rss_kib(pid)
    t0_s = time.monotonic()
    outcome = asyncio.run(fuzz_load(url, num_bodies, seed))
    elapsed_s = time.monotonic() - t0_s
    wait_idle(url)
    after = rss_kib(pid)
    num_5xx = sum(count for status, count in outcome["statuses"].items() if status >= 500)
    note = (
        f"{num_bodies} bodies in {elapsed_s:.1f} s, {num_5xx} 5xx, "
        f"{outcome['greedy_streams']} greedy streams alongside"
    )
    return {"before": before, "peak": max(before, after), "after": after, "note": note}


@click.command()
@click.option("--clients", default=20, show_default=True, help="Clients that stop reading.")
@click.option("--stall-s", default=30.0, show_default=True, help="How long they read nothing.")
@click.option("-n", "--samples", default=4, show_default=True, help="n of each stalled stream.")
@click.option("--logprobs", default=0, show_default=True, help="logprobs of each stalled stream.")
@click.option("--fuzz-bodies", default=600, show_default=True)
@click.option("--seed", default=0, show_default=True)
def main(clients, stall_s, samples, logprobs, fuzz_bodies, seed):
    config = ManagedServerConfig(model="tiny-random", extra_args=SERVER_ARGS, startup_timeout_s=120)
    with managed_server(config) as server:
        url = server.base_url.removesuffix("/v1")
        rows = {
            "slow readers": slow_readers(
                url, server.pid, clients=clients, stall_s=stall_s, n=samples, logprobs=logprobs
            ),
            "fuzz": fuzz(url, server.pid, num_bodies=fuzz_bodies, seed=seed),
        }
    print(
        f"{'measurement':<14} {'before MiB':>10} {'peak MiB':>9} {'after MiB':>9} {'change':>7}  notes"
    )
    for name, row in rows.items():
        change = 100 * (row["after"] - row["before"]) / row["before"]
        print(
            f"{name:<14} {row['before'] / 1024:>10.1f} {row['peak'] / 1024:>9.1f} "
            f"{row['after'] / 1024:>9.1f} {change:>+6.1f}%  {row['note']}"
        )


if __name__ == "__main__":
    main()
