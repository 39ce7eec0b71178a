"""The `fair` scheduling policy through `LLMEngine.step`, on hand-worked mixes: one sequence
runs at a time (max_num_seqs 1), every prompt is 4 tokens and every request 2 output tokens, so
each request charges its tenant 4 x 1 (its prompt positions) + 1 x 2 (the position of its
first output token, computed by the decode step that samples the second) = 6 units / weight.
The order requests finish in is written out beside each case, worked by hand from the counters
(ties: arrival order)."""

from __future__ import annotations

import json

import pytest
from policy_util import finish_order

from engine_ref import EngineConfig, EngineConfigError, EngineError, LLMEngine, SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def make(tiny_model, policy: str, weights: dict | None = None) -> LLMEngine:
    config = EngineConfig(model="tiny-random", dtype="float32", device="cpu", num_blocks=64,
                          num_threads=1, max_num_seqs=1, scheduling_policy=policy,
                          tenant_weights=None if weights is None else json.dumps(weights))  # fmt: skip
    return LLMEngine(config, loaded=tiny_model)


def add(engine: LLMEngine, names: str) -> None:
    """Requests named like "a1": the letter is the tenant."""
    for i, name in enumerate(names.split()):
        prompt = [10 + i, 11 + i, 12 + i, 13 + i]
        engine.add_request(name, prompt, PARAMS, tenant=name[0].upper())


@pytest.mark.parametrize(
    ("policy", "weights", "expected"),
    [
        # fcfs: arrival order, whoever asks.
        ("fcfs", None, "a1 a2 a3 b1 b2 b3"),
        # fair: a1 (A 6), b1 (B 6), tie -> earlier arrival a2 (A 12), b2 (B 12), a3, b3.
        ("fair", None, "a1 b1 a2 b2 a3 b3"),
        # B weighs 2 (3 units a request): a1 (A 6), b1 (B 3), b2 (B 6), tie -> a2 (A 12),
        # b3 (B 9), a3.
        ("fair", {"B": 2}, "a1 b1 b2 a2 b3 a3"),
        # A weighs 0.5 (12 units a request): a1 (A 12), b1 (B 6), b2 (B 12), tie -> a2
        # (A 24), b3 (B 18), a3.
        ("fair", {"A": 0.5}, "a1 b1 b2 a2 b3 a3"),
    ],
)
def test_finish_order_by_policy(tiny_model, policy, weights, expected):
    engine = make(tiny_model, policy, weights)
    add(engine, "a1 a2 a3 b1 b2 b3")
    assert finish_order(engine) == expected.split()
    assert engine.stats().num_blocks_used == 0


def test_a_tenant_back_from_idle_starts_at_the_smallest_active_counter(tiny_model):
    """A alone serves a1 and a2 (A 12); then C arrives idle at counter 0 and is lifted to 12:
    tie -> a3 (earlier) (A 18), c1 (C 18), tie -> a4 (A 24), c2. Without the lift C would take
    c1 and c2 first."""
    engine = make(tiny_model, "fair")
    add(engine, "a1 a2 a3 a4")
    assert finish_order(engine, steps=4) == ["a1", "a2"]
    fair = engine.scheduler.fair
    assert fair.counters["A"] == 12
    engine.add_request("c1", [40, 41, 42, 43], PARAMS, tenant="C")
    assert fair.counters["C"] == 12  # lifted, not 0
    engine.add_request("c2", [44, 45, 46, 47], PARAMS, tenant="C")
    assert fair.counters["C"] == 12  # C is active now: no second lift
    assert finish_order(engine) == ["a3", "c1", "a4", "c2"]
    assert fair.counters == {"A": 24, "C": 24}


def test_requests_without_a_tenant_share_one(tiny_model):
    engine = make(tiny_model, "fair")
    for name in ("x1", "x2"):
        engine.add_request(name, [5, 6, 7, 8], PARAMS)
    engine.add_request("b1", [5, 6, 7, 9], PARAMS, tenant="B")
    # x1 ("" 6), b1 (B 6), x2.
    assert finish_order(engine) == ["x1", "b1", "x2"]
    assert engine.scheduler.fair.counters == {"": 12, "B": 6}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"scheduling_policy": "lottery"},
            "Unknown scheduling_policy 'lottery'; use fcfs, priority, edf, fair, affinity.",
        ),
        ({"tenant_weights": '{"a": 0}'}, "tenant weight 'a' must be a positive number, got 0."),
        ({"tenant_weights": '{"a": -1.5}'}, "tenant weight 'a' must be a positive number"),
        ({"tenant_weights": '{"a": true}'}, "tenant weight 'a' must be a positive number"),
        ({"tenant_weights": '{"a": "2"}'}, "tenant weight 'a' must be a positive number"),
        ({"tenant_weights": "[2]"}, "tenant_weights must map tenant names to weights"),
        ({"tenant_weights": "{not json"}, "tenant_weights must map tenant names to weights"),
    ],
)
def test_policy_options_are_checked(options, message):
    with pytest.raises(EngineConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**options)


@pytest.mark.parametrize("tenant", [7, "t" * 257])
def test_a_bad_tenant_is_refused(tiny_model, tenant):
    engine = make(tiny_model, "fair")
    with pytest.raises(EngineError, match="tenant must be a string of at most 256 characters"):
        engine.add_request("a", [5, 6, 7], PARAMS, tenant=tenant)
    engine.add_request("b", [5, 6, 7], PARAMS, tenant="t" * 256)  # at the bound


def test_the_openai_user_field_is_the_tenant_over_http(tiny_model):
    """`user` reaches the fair policy's counters through the server (two requests of A, one
    of B, one at a time: 6 units each); a `user` over the bound is a 400 naming it."""
    from server_fixtures import exchange, running_server

    from engine_ref.serving.engine_thread import ThreadEngineLoop
    from engine_ref.serving.server import ServerConfig

    engine = make(tiny_model, "fair")
    with running_server(ServerConfig(port=0), engine_loop=ThreadEngineLoop(engine)) as url:
        for user in ("A", "A", "B"):
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "ignore_eos": True, "user": user}
            status, _, answer = exchange(url, _post("/v1/completions", body))
            assert status == 200, answer
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "user": "u" * 257}
        status, _, answer = exchange(url, _post("/v1/completions", body))
        assert status == 400 and answer["error"]["param"] == "user"
    assert dict(engine.scheduler.fair.counters) == {"A": 12, "B": 6}


def _post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data
