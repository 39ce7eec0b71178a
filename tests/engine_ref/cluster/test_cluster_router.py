"""The router in front of two tiny-random workers, through HTTP and `bench run`: outputs equal a
single engine's, every route answers as the single server does, /metrics merges the workers'
with a worker label, and prefix-affinity keeps a shared prefix on one worker's cache.

One cluster (prefix-affinity) and one single server serve the whole module."""

from __future__ import annotations

import json

import pytest
from cluster_util import (
    bench_run_mixed_checked,
    post_json,
    request,
    running_cluster,
    sse_events,
    worker_processes,
)
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import running_server

from engine_ref.serving.interface import EngineConfig
from engine_ref.serving.server import ServerConfig

pytestmark = pytest.mark.slow  # starts worker processes

ENGINE = EngineConfig(model="tiny-random", dtype="float32", num_blocks=256, max_num_seqs=16)
BLOCK = ENGINE.block_size  # 16


@pytest.fixture(scope="module")
def cluster():
    config = ServerConfig(engine=ENGINE, port=0)
    with running_cluster(config, replicas=2, policy="prefix-affinity") as url:
        yield url


@pytest.fixture(scope="module")
def single():
    with running_server(ServerConfig(engine=ENGINE, port=0)) as url:
        yield url


def _samples(url: str) -> list:
    """Every sample of the router's /metrics, through prometheus_client's parser."""
    status, _, raw = request(url, "/metrics")
    assert status == 200
    return [s for family in text_string_to_metric_families(raw.decode()) for s in family.samples]


def _total(samples, name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


PROMPTS = ["The cat sat on", "Once upon a time in a land", "1 2 3 4 5 6", "def f(x):"]


def _body(kind: str, prompt: str) -> tuple[str, dict]:
    common = {"model": "tiny-random", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if kind == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, "prompt": prompt, "return_token_ids": True}


def _output(kind: str, url: str, prompt: str, stream: bool) -> tuple:
    path, body = _body(kind, prompt)
    if not stream:
        status, answer = post_json(url, path, body)
        assert status == 200, answer
        choice = answer["choices"][0]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        return text, choice.get("token_ids"), choice["finish_reason"]
    events = sse_events(url, path, body)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    pieces = [c["delta"].get("content") or "" if kind == "chat" else c["text"] for c in chunks]
    ids = [t for c in chunks for t in c.get("token_ids") or []]
    return "".join(pieces), ids or None, chunks[-1]["finish_reason"], len(events)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_greedy_outputs_equal_a_single_engines(cluster, single, kind, stream):
    before = _samples(cluster)
    through_router = [_output(kind, cluster, p, stream) for p in PROMPTS]
    assert through_router == [_output(kind, single, p, stream) for p in PROMPTS]
    assert all(out[2] == "length" for out in through_router)
    after = _samples(cluster)
    served = [
        _total(after, "router_requests_total", worker=w)
        - _total(before, "router_requests_total", worker=w)
        for w in ("0", "1")
    ]
    assert sum(served) == len(PROMPTS), served
    # Short completions have no full block: least-loaded spreads them over both workers. Chat
    # prompts share the template's first block, so affinity keeps them on one.
    assert min(served) > 0 if kind == "completions" else max(served) == len(PROMPTS), served


def test_bench_run_checks_the_mixed_workloads_outputs_through_the_router(cluster, tmp_path):
    out = tmp_path / "run"
    bench_run_mixed_checked(cluster, out)


def test_metrics_merge_the_workers_with_a_label_and_count_what_was_routed(cluster):
    before = _samples(cluster)
    n = 6
    for i in range(n):
        status, _ = post_json(cluster, *_body("completions", f"{i} metrics"))
        assert status == 200
    status, _, raw = request(cluster, "/metrics")
    text = raw.decode()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))  # one TYPE per family
    after = [s for f in text_string_to_metric_families(text) for s in f.samples]
    engine = [s for s in after if s.name.startswith("vllm:")]
    assert engine and {s.labels.get("worker") for s in engine} == {"0", "1"}
    assert {s.labels["policy"] for s in after if s.name == "router_requests_total"} == {
        "prefix-affinity"
    }

    def delta(name: str, worker: str) -> float:
        return _total(after, name, worker=worker) - _total(before, name, worker=worker)

    routed = [delta("router_requests_total", w) for w in ("0", "1")]
    finished = [delta("vllm:request_success_total", w) for w in ("0", "1")]
    assert sum(routed) == n and routed == finished  # each worker finished what it was sent
    assert [_total(after, "router_inflight", worker=w) for w in ("0", "1")] == [0, 0]
    assert [_total(after, "router_worker_up", worker=w) for w in ("0", "1")] == [1, 1]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Say which worker", "max_tokens": 2}),
        ("/v1/completions", {"prompt": "Say which worker", "max_tokens": 2, "stream": True}),
        ("/v1/embeddings", {"input": "Say which worker"}),
    ],
)
def test_each_answer_names_the_worker_that_served_it(cluster, path, body):
    before = _samples(cluster)
    status, headers, _ = request(cluster, path, {"model": "tiny-random", **body})
    assert status == 200
    name = headers["x-bench-worker"]
    assert name in ("worker-0", "worker-1")
    after = _samples(cluster)
    index = name.removeprefix("worker-")
    routed = {
        w: _total(after, "router_requests_total", worker=w)
        - _total(before, "router_requests_total", worker=w)
        for w in ("0", "1")
    }
    assert routed == {index: 1, str(1 - int(index)): 0}


def test_a_shared_prefix_stays_on_one_workers_cache(cluster):
    """Five prompts sharing three full blocks (48 tokens), sent one after another: all go to
    one worker, and every one after the first finds those 48 tokens in its cache."""
    shared = [(7 * i) % 200 + 3 for i in range(3 * BLOCK)]
    before = _samples(cluster)
    for tail in range(5):
        prompt = shared + [250 + tail, 251, 252]
        body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        assert post_json(cluster, "/v1/completions", body)[0] == 200
    after = _samples(cluster)

    def delta(name: str, worker: str) -> float:
        return _total(after, name, worker=worker) - _total(before, name, worker=worker)

    routed = sorted(delta("router_requests_total", w) for w in ("0", "1"))
    assert routed == [0, 5]
    hits = sum(delta("vllm:prefix_cache_hits_total", w) for w in ("0", "1"))
    assert hits == 4 * 3 * BLOCK  # 192
    assert _total(after, "router_prefix_affinity_fallbacks_total") == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/v1/completions", b'{"model": "tiny-', 400, "not valid JSON"),
        ("/v1/completions", {"model": "tiny-random", "prompt": "x", "max_tokens": -1}, 400,
         "max_tokens"),
        ("/v1/chat/completions", {"model": "nope", "messages": []}, 404, "nope"),
        ("/v1/messages", {"model": "tiny-random", "max_tokens": 4}, 400, "messages"),
    ],
)  # fmt: skip
def test_a_bad_request_gets_the_workers_4xx(cluster, single, path, body, status, says):
    got = request(cluster, path, body)
    want = request(single, path, body)
    assert (got[0], want[0]) == (status, status)
    assert json.loads(got[2]) == json.loads(want[2]) and says in got[2].decode()


def _without_ids(body: object) -> object:
    """`body` without what differs between two answers to the same request."""
    if isinstance(body, dict):
        volatile = {"id", "created", "created_at", "usage"}
        return {k: _without_ids(v) for k, v in body.items() if k not in volatile}
    if isinstance(body, list):
        return [_without_ids(v) for v in body]
    return body


def test_the_other_routes(cluster, single):
    status, _, raw = request(cluster, "/health")
    assert (status, raw) == (200, b"ok")
    status, _, raw = request(cluster, "/info")
    info = json.loads(raw)
    assert status == 200 and info["engine"] == "engine_ref" and info["model"] == "tiny-random"
    workers = info["cluster"]["workers"]
    assert info["cluster"] == {"replicas": 2, "router": "prefix-affinity", "workers": workers}
    assert len(set(workers)) == 2 and all(w.startswith("http://127.0.0.1:") for w in workers)
    status, models = post_json(cluster, "/v1/models", None)
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny-random"]
    for path, body in [
        ("/v1/embeddings", {"model": "tiny-random", "input": ["a b c", "d"]}),
        ("/v1/responses", {"model": "tiny-random", "input": "hi", "max_output_tokens": 4,
                           "temperature": 0}),
        ("/v1/messages", {"model": "tiny-random", "max_tokens": 4, "temperature": 0,
                          "messages": [{"role": "user", "content": "hi"}]}),
    ]:  # fmt: skip
        got, want = post_json(cluster, path, body), post_json(single, path, body)
        assert got[0] == want[0] == 200
        assert _without_ids(got[1]) == _without_ids(want[1])
    assert len(worker_processes()) == 2
