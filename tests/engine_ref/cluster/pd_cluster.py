"""Test support for the P/D cluster: the router in P/D mode (with its prefill and decode worker
processes) on a background thread, and reading the workers' live KV blocks from its /metrics."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

from cluster_util import request, running_router
from prometheus_client.parser import text_string_to_metric_families

from engine_ref.cluster.pd import serve_pd_cluster
from engine_ref.serving.server import ServerConfig


@contextlib.contextmanager
def running_pd_cluster(
    config: ServerConfig, *, prefill: int, decode: int, startup_timeout_s: float = 120.0, **kw
) -> Iterator[str]:
    """`serve_pd_cluster` on a background thread; yields the router's URL and, on exit, stops
    it and checks that no worker process is left."""
    serving = functools.partial(
        serve_pd_cluster, config, prefill_workers=prefill, decode_workers=decode, **kw
    )
    with running_router(serving, startup_timeout_s) as url:
        yield url


def samples(url: str) -> list:
    status, _, raw = request(url, "/metrics")
    assert status == 200
    return [s for f in text_string_to_metric_families(raw.decode()) for s in f.samples]


def blocks_used(url: str) -> dict[str, float]:
    """Each live worker's `vllm:kv_cache_blocks_used`, by worker label."""
    return {
        s.labels["worker"]: s.value for s in samples(url) if s.name == "vllm:kv_cache_blocks_used"
    }


def assert_no_block_held(url: str, *, wait_s: float = 5.0) -> None:
    """Every worker's live-block gauge back at 0 (a release lands a step later: waits)."""
    deadline = time.monotonic() + wait_s
    while True:
        used = blocks_used(url)
        if used and not any(used.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks still held: {used}")
        time.sleep(0.05)


def transfers(url: str) -> dict[tuple[str, str], float]:
    """`router_kv_transfers_total` by (decode worker, result)."""
    return {
        (s.labels["worker"], s.labels["result"]): s.value
        for s in samples(url)
        if s.name == "router_kv_transfers_total"
    }
