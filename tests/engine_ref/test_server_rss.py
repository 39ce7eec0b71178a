"""Memory of the server subprocess (VmRSS) around clients that stop reading: 20 streams whose
clients read the response head and then nothing for 20 s. Afterwards nothing runs, every one of
them counts as an abort, and RSS is back within 10% of its high-water mark before (set by a
warm-up round of the same requests read normally and one round of them stalled just as long).
`benchmarks/server_rss.py` reproduces this measurement and the fuzz run's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
from server_fixtures import (
    connect,
    idle_gauges,
    metric,
    post_bytes,
    read_head,
    rss_kib,
    scrape,
    server_process,
    wait_until,
)

NUM_CLIENTS = 20
STALL_S = 20.0
SERVER_ARGS = (
    "--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "64MiB",
    "--stream-write-timeout", "3", "--max-stream-backlog", "64",
)  # fmt: skip


def _body(seed: int, max_tokens: int) -> dict:
    return {
        "prompt": list(range(10, 40)),
        "max_tokens": max_tokens,
        "n": 4,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": seed,
        "stream": True,
    }


async def _read_all(url: str, max_tokens: int) -> None:
    async def one(session: aiohttp.ClientSession, seed: int) -> None:
        async with session.post(url + "/v1/completions", json=_body(seed, max_tokens)) as response:
            assert response.status == 200
            async for _ in response.content.iter_any():
                pass

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(one(session, seed) for seed in range(NUM_CLIENTS)))


def _stall_round(url: str, pid: int, stall_s: float) -> int:
    """NUM_CLIENTS streams whose clients read the head and then nothing for `stall_s`; returns
    the peak RSS (KiB) seen meanwhile, once the server is idle again."""
    peak_kib = rss_kib(pid)
    with contextlib.ExitStack() as sockets:
        for seed in range(NUM_CLIENTS):
            sock = sockets.enter_context(connect(url, rcvbuf_bytes=4096))
            body = json.dumps(_body(seed, max_tokens=4000)).encode()
            sock.sendall(post_bytes("/v1/completions", body))
            assert read_head(sock)[0] == 200
        t0_s = time.monotonic()
        while time.monotonic() - t0_s < stall_s:
            peak_kib = max(peak_kib, rss_kib(pid))
            assert scrape(url)  # /metrics (and the event loop) answer meanwhile
            time.sleep(1.0)
    assert wait_until(lambda: idle_gauges(scrape(url)) == (0, 0, 0), timeout_s=60)
    return peak_kib


@pytest.mark.slow
@pytest.mark.soak  # three 20 s stalls: a soak
def test_clients_that_stop_reading_leave_rss_where_it_was(tmp_path):
    with server_process(tmp_path, *SERVER_ARGS) as (url, pid):
        asyncio.run(_read_all(url, max_tokens=1000))  # warm-up: the same load, read
        assert wait_until(lambda: idle_gauges(scrape(url)) == (0, 0, 0), timeout_s=60)
        # and one round of the stalled load itself, as long as the measured one: how many outputs
        # queue behind a stalled client before it is abandoned depends on the machine's speed and
        # on how long it stalls, so the allocator's high-water mark is set by this round, not by
        # the measured one (CI, on a loaded machine, saw +10.7% with no such round and +12.2%
        # with an 8 s one; repeated rounds of the same length plateau).
        # "Before" is the high-water mark so far: RSS itself wanders by several percent
        # between idle moments (the allocator trims and regrows), which is not a leak.
        # Two such rounds since the engine stopped importing TorchDynamo: its import left about
        # 140 MB freed inside the heap, which the first round's backlog reused; without it the
        # mark rises over two rounds, then plateaus (peaks 345, 360, 363, 366 MiB over four).
        warm_peak_kib = max(_stall_round(url, pid, STALL_S), _stall_round(url, pid, STALL_S))
        rss_before_kib = max(rss_kib(pid), warm_peak_kib)
        aborts_before = metric(scrape(url), "vllm:request_success_total", finished_reason="abort")
        peak_kib = _stall_round(url, pid, STALL_S)
        text = scrape(url)
        aborts = metric(text, "vllm:request_success_total", finished_reason="abort")
        rss_after_kib = rss_kib(pid)
    change = (rss_after_kib - rss_before_kib) / rss_before_kib
    print(
        f"\nslow readers: {NUM_CLIENTS} clients stalled {STALL_S:.0f} s; server RSS "
        f"{rss_before_kib / 1024:.1f} MiB before, peak {peak_kib / 1024:.1f}, "
        f"{rss_after_kib / 1024:.1f} after ({100 * change:+.1f}%)"
    )
    assert aborts - aborts_before == NUM_CLIENTS
    assert abs(change) <= 0.10
