"""P/D failures are explicit: a decode worker without free blocks makes the router answer 503
with Retry-After (an error event once the stream has begun), a handoff nobody attaches to is
freed after the park timeout, an unreachable decode worker fails the transfer (the prefill
worker still frees its blocks), a transfer that fails its checksum is recomputed on the other
decode worker, and a killed decode worker leaves the other one serving, then none (503). No
worker holds a KV block after any of it.

One cluster (one prefill, two decode workers; 16 blocks each, a 0.4 s install wait, a 1 s park
timeout) serves the module; the tests run in order and the last ones kill decode workers."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

import pytest
from cluster_util import post_json, request, sse_events, worker_processes
from pd_cluster import assert_no_block_held, blocks_used, running_pd_cluster, transfers

from engine_ref.serving.interface import EngineConfig
from engine_ref.serving.server import ServerConfig

pytestmark = pytest.mark.slow  # starts worker processes

ENGINE = EngineConfig(model="tiny-random", dtype="float32", num_blocks=16, max_num_seqs=4)
PREFILL, DECODE_A, DECODE_B = "0", "1", "2"


@pytest.fixture(scope="module")
def cluster():
    config = ServerConfig(engine=ENGINE, port=0, enable_fault_injection=True)
    with running_pd_cluster(
        config, prefill=1, decode=2, install_wait_s=0.4, park_timeout_s=1.0
    ) as url:
        yield url


@pytest.fixture(scope="module")
def layout(cluster) -> dict:
    return post_json(cluster, "/info", None)[1]["cluster"]["pd"]


def _completion(prompt: list[int], max_tokens: int, **extra) -> dict:
    return {"model": "tiny-random", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}  # fmt: skip


def _ids(n: int, seed: int) -> list[int]:
    return [(13 * i + seed) % 400 + 20 for i in range(n)]


def _wait(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_no_free_blocks_on_the_decode_worker_is_an_explicit_503(cluster):
    # Two plain requests (n=2 is not P/D: each goes to a decode worker) hold 13 of each decode
    # worker's 16 blocks (7 shared prompt blocks, then up to 4 per sample) for 48 steps
    # slowed to 80 ms: the two requests below each wait their 0.4 s for blocks meanwhile.
    assert post_json(cluster, "/admin/step_delay", {"delay_ms": 80})[0] == 200
    blockers = [
        threading.Thread(
            target=sse_events, args=(cluster, "/v1/completions", _completion(_ids(120, s), 48, n=2))
        )
        for s in (1, 2)
    ]
    try:
        for blocker in blockers:
            blocker.start()
        _wait(lambda: blocks_used(cluster).get(DECODE_A, 0) >= 9
              and blocks_used(cluster).get(DECODE_B, 0) >= 9, "the blockers")  # fmt: skip
        before = transfers(cluster)
        body = _completion(_ids(150, 3), 4)  # 10 blocks: more than either decode worker has
        status, headers, raw = request(cluster, "/v1/completions", body)
        assert status == 503, raw
        assert headers["retry-after"] == "1"
        assert "free KV blocks" in json.loads(raw)["error"]["message"]
        events = sse_events(cluster, "/v1/completions", body)
        assert events[0]["choices"][0]["finish_reason"] is None  # the first token came first
        assert events[-1]["error"]["code"] == "no_free_blocks"
        refused = sum(
            v for (_, result), v in transfers(cluster).items() if result == "no_free_blocks"
        )
        assert refused - sum(v for (_, r), v in before.items() if r == "no_free_blocks") == 2
    finally:
        for blocker in blockers:
            blocker.join(30)
        post_json(cluster, "/admin/step_delay", {"delay_ms": 0})
    assert_no_block_held(cluster)


def test_a_handoff_nobody_attaches_to_is_freed(cluster, layout):
    # Sent by hand to the prefill worker, so no decode leg follows. Steps slowed to 40 ms, the
    # installed request would decode for 8 s; the 1 s park timeout aborts it long before.
    prefill_url = layout["prefill_workers"][0]
    kv_port = layout["decode_workers"][0]["kv_port"]
    transfer_id = uuid.uuid4().hex
    params = {"do_remote_decode": True, "transfer_id": transfer_id,
              "decode_kv": f"127.0.0.1:{kv_port}"}  # fmt: skip
    body = _completion(_ids(40, 4), 200, kv_transfer_params=params)
    assert post_json(cluster, "/admin/step_delay", {"delay_ms": 40})[0] == 200
    try:
        status, answer = post_json(prefill_url, "/v1/completions", body)
        assert status == 200 and answer["usage"]["kv_transfer"]["ok"] is True
        assert blocks_used(cluster)[DECODE_A] >= 3  # installed: 41 tokens in 3 blocks, growing
        assert_no_block_held(cluster, wait_s=5.0)  # aborted at the park timeout, not at 8 s
    finally:
        post_json(cluster, "/admin/step_delay", {"delay_ms": 0})
    late = {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id}}
    status, _, raw = request(layout["decode_workers"][0]["url"], "/v1/completions", late)
    assert status == 404 and "No KV handoff arrived" in json.loads(raw)["error"]["message"]


def test_an_unreachable_decode_worker_fails_the_transfer_and_frees_the_prefill_blocks(
    cluster, layout
):
    params = {"do_remote_decode": True, "transfer_id": "t1", "decode_kv": "127.0.0.1:1"}
    body = _completion(_ids(40, 5), 5, kv_transfer_params=params)
    status, answer = post_json(layout["prefill_workers"][0], "/v1/completions", body)
    assert status == 200
    kv = answer["usage"]["kv_transfer"]
    assert kv["ok"] is False and kv["error_kind"] == "ConnectionRefusedError"
    assert len(kv["first_token_ids"]) == 1
    assert_no_block_held(cluster)


def test_a_failed_transfer_is_recomputed_on_the_other_decode_worker(cluster):
    body = _completion(_ids(20, 7), 5, return_token_ids=True)
    status, expected = post_json(cluster, "/v1/completions", body)
    assert status == 200
    before = transfers(cluster)
    faulty = {**body, "kv_transfer_params": {"fault": "flip_bit"}}
    status, answer = post_json(cluster, "/v1/completions", faulty)
    assert status == 200
    assert answer["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    assert answer["usage"]["kv_transfer"]["retried"] == "recompute"
    gained = {k: v - before.get(k, 0) for k, v in transfers(cluster).items()}
    gained = {k: v for k, v in gained.items() if v}
    ((failed_on, _),) = [k for k in gained if k[1] == "failed"]
    other = ({DECODE_A, DECODE_B} - {failed_on}).pop()
    assert gained == {(failed_on, "failed"): 1, (other, "recomputed"): 1}
    assert_no_block_held(cluster)


def _kill(index: int) -> None:
    """SIGKILL worker `index` (its process is named engine-worker-<index>)."""
    (process,) = [p for p in worker_processes() if p.name == f"engine-worker-{index}"]
    os.kill(process.pid, signal.SIGKILL)


def test_a_killed_decode_worker_leaves_the_other_serving_then_none(cluster):
    body = _completion(_ids(20, 6), 5, return_token_ids=True)
    status, expected = post_json(cluster, "/v1/completions", body)
    assert status == 200
    _kill(2)
    _wait(lambda: request(cluster, "/health")[0] == 200
          and b"degraded" in request(cluster, "/health")[2], "the router to notice")  # fmt: skip
    for _ in range(2):  # both go to the decode worker left
        status, answer = post_json(cluster, "/v1/completions", body)
        assert status == 200
        assert answer["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
        assert answer["usage"]["kv_transfer"]["ok"] is True
    _kill(1)
    _wait(lambda: DECODE_A not in blocks_used(cluster), "the router to notice")
    status, _, raw = request(cluster, "/v1/completions", body)
    assert status == 503
    assert json.loads(raw)["error"]["message"] == "No decode worker of this cluster is running."
    assert blocks_used(cluster) == {PREFILL: 0.0}
