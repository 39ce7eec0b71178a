"""Workers placed as Ray actors (`engine_ref.cluster.ray_placement`) on a local two-node Ray
cluster: one worker per node, each serving the single server's greedy outputs over HTTP, a
worker whose server dies reported once through `watch`, and nothing left after `stop`; the
router over Ray-placed workers (`bench serve --replicas 2 --ray ADDRESS`) answers as a single
engine, so does a P/D pair placed on the two nodes (its KV crossing between them), and `--ray`
alone is one sentence.
Without Ray installed the Ray tests skip with the allow-listed reason (CI installs the extra)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner
from cluster_util import post_json, running_router, worker_processes
from server_fixtures import running_server

from engine_ref.cluster.router import serve_cluster
from engine_ref.serving.interface import EngineConfig
from engine_ref.serving.server import ServerConfig, ServerError
from harness.cli import bench

pytestmark = pytest.mark.slow  # starts Ray nodes and worker processes

NO_RAY = "Ray is not installed (pip install 'llm-bench-harness[ray]'); CI installs the extra"
ENGINE = EngineConfig(model="tiny-random", dtype="float32", num_blocks=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray cluster on loopback, a head node and one more, one CPU each (as the harness's
    `--ray` test builds it), joined by this process."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray", reason=NO_RAY)
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    if ray_constants.ENABLE_RAY_CLUSTER:
        pytest.skip("Ray was imported before loopback could be chosen; run this test alone")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=1)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        mp.undo()


def _greedy(url: str, prompt: str = "a b c d e f") -> str:
    status, body = post_json(url, "/v1/completions", {
        "model": "tiny-random", "prompt": prompt, "max_tokens": 6, "temperature": 0,
    })  # fmt: skip
    assert status == 200, body
    return body["choices"][0]["text"]


def test_one_worker_per_node_serves_and_a_dead_one_is_reported(two_nodes):
    from engine_ref.cluster.ray_placement import start_ray_workers, stop_ray_workers

    config = ServerConfig(engine=ENGINE, port=0)
    workers = start_ray_workers(config, 2, two_nodes.address, startup_timeout_s=120)
    try:
        assert [w.index for w in workers] == [0, 1]
        assert len({w.node for w in workers}) == 2  # spread: one actor on each node
        assert all(w.url.startswith("http://127.0.0.1:") and w.alive for w in workers)
        texts = [_greedy(w.url) for w in workers]
        assert texts[0] == texts[1] and texts[0]
        # The first worker's server process dies: the watch reports it once, with how.
        pid = _server_pid(workers[0].url)
        seen = []

        async def watch_until_reported():
            workers[0].watch(seen.append)
            os.kill(pid, signal.SIGKILL)
            for _ in range(300):
                if seen:
                    return
                await asyncio.sleep(0.1)

        asyncio.run(watch_until_reported())
        assert seen == [workers[0]] and not workers[0].alive
        assert workers[0].exit_description() == "was killed by SIGKILL"
        assert workers[1].alive and _greedy(workers[1].url) == texts[0]
    finally:
        stop_ray_workers(workers)
    assert not workers[1].alive


def test_the_router_serves_through_ray_placed_workers(two_nodes):
    import ray

    config = ServerConfig(engine=ENGINE, port=0)
    serving = functools.partial(
        serve_cluster, config, replicas=2, policy="round-robin", ray_address=two_nodes.address
    )
    with running_server(config) as single:
        expected = _greedy(single)
    with running_router(serving, startup_timeout_s=120) as url:
        assert worker_processes() == []  # no worker started on this host's process tree
        assert ray.available_resources().get("CPU", 0) == 0  # both nodes' CPU: one actor each
        texts = [_greedy(url), _greedy(url)]  # round-robin: each worker once
        status, info = post_json(url, "/info", None)
    assert texts == [expected, expected] and expected
    assert status == 200 and info["cluster"]["replicas"] == 2
    assert len(info["cluster"]["workers"]) == 2
    assert len(set(info["cluster"]["workers"])) == 2


def test_pd_workers_on_two_nodes_hand_the_kv_over_and_answer_as_a_single_engine(two_nodes):
    """`bench serve --prefill-workers 1 --decode-workers 1 --ray ADDRESS`: the prefill worker on
    one node, the decode worker on the other, each a Ray actor's server process; every request
    hands its KV over the decode worker's KV link (on its node's address) and the greedy text
    equals a single engine's; a killed decode worker (the fault plans' kill) is reported down;
    nothing is left on this host after."""
    import ray

    from engine_ref.cluster.pd import serve_pd_cluster

    config = ServerConfig(engine=ENGINE, port=0, enable_fault_injection=True)
    serving = functools.partial(
        serve_pd_cluster, config, prefill_workers=1, decode_workers=1,
        ray_address=two_nodes.address,
    )  # fmt: skip
    with running_server(config) as single:
        expected = [_greedy(single, prompt) for prompt in PROMPTS]
    with running_router(serving, startup_timeout_s=120) as url:
        assert worker_processes() == []  # both workers on Ray, none in this process tree
        assert ray.available_resources().get("CPU", 0) == 0  # one actor on each node
        answers = [_completion(url, prompt) for prompt in PROMPTS]
        status, info = post_json(url, "/info", None)
        assert status == 200, info
        (decode,) = info["cluster"]["pd"]["decode_workers"]
        assert decode["kv_port"] and decode["url"].startswith("http://127.0.0.1:")
        status, killed = post_json(url, "/admin/cluster_fault", {"kind": "kill_decode_worker"})
        health, said = post_json(url, "/health", None)
    assert [a["choices"][0]["text"] for a in answers] == expected and all(expected)
    for answer in answers:
        kv = answer["usage"]["kv_transfer"]
        assert kv["ok"] and kv["bytes"] > 0 and not kv["retried"], kv
    assert status == 200 and killed == {"kind": "kill_decode_worker", "killed": 1}, killed
    assert health == 200 and said["status"] == "degraded", said  # the dead one is down


PROMPTS = ["a b c d e f", "one two three four five six seven eight nine ten eleven twelve"]


def _completion(url: str, prompt: str) -> dict:
    status, body = post_json(url, "/v1/completions", {
        "model": "tiny-random", "prompt": prompt, "max_tokens": 6, "temperature": 0,
    })  # fmt: skip
    assert status == 200, body
    return body


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--ray", "local"], "--ray needs --replicas 2 or more, or P/D workers."),
        (["--replicas", "1", "--ray", "local"], "--ray needs --replicas 2 or more, or P/D"),
    ],
)  # fmt: skip
def test_ray_without_replicas_is_one_sentence(args, says):
    result = CliRunner().invoke(bench, ["serve", "--model", "tiny-random", *args])
    assert result.exit_code == 2 and says in result.output, result.output


def _server_pid(url: str) -> int:
    """The pid listening on `url`'s port (the worker's server process), from `ss`."""
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True
    ).stdout
    return int(out.split("pid=")[1].split(",")[0])


def test_without_ray_the_extra_is_named(monkeypatch):
    import engine_ref.cluster.ray_placement as placement

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ServerError) as caught:
        placement.require_ray()
    assert str(caught.value) == placement.INSTALL_SENTENCE
