"""A full waiting queue answered by policy (`engine_ref.core.overload`), through
`LLMEngine.add_request` / `step` and over HTTP: who is refused, who is shed (finish_reason
"shed"), the counts by reason in `EngineStats` and `/metrics`, the bounded queue's memory, and
the new command-line options."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from click.testing import CliRunner
from policy_util import PARAMS, ManualClock, finish_order, make, prompt

from engine_ref import QueueFullError
from engine_ref.core.overload import SHED_REASONS, DeadlineInfeasibleError
from engine_ref.core.step_meter import StepRates


def _shed_counts(engine) -> dict[str, int]:
    return {k: v for k, v in engine.stats().requests_shed_by_reason.items() if v}


def _final_reasons(engine) -> dict[str, str]:
    """One step's finished outputs: request id -> finish reason."""
    return {o.request_id: o.outputs[0].finish_reason for o in engine.step() if o.finished}


@pytest.mark.parametrize("policy", ["fcfs", "affinity"])
def test_fcfs_and_affinity_refuse_the_newcomer(tiny_model, policy):
    engine = make(tiny_model, policy, max_waiting_requests=2)
    engine.add_request("a", prompt(4, 0), PARAMS)
    engine.add_request("b", prompt(4, 10), PARAMS)  # at the bound now
    with pytest.raises(QueueFullError, match=r"^Waiting queue is full \(2 requests\); retry"):
        engine.add_request("c", prompt(4, 20), PARAMS, priority=-100)
    assert sorted(engine.requests) == ["a", "b"]
    assert _shed_counts(engine) == {"queue_full": 1}
    assert finish_order(engine) == ["a", "b"]


def test_priority_sheds_the_worst_waiting_request_for_a_better_newcomer(tiny_model):
    """Queue bound 2, nothing stepped: p5, p3 wait. p4 is better than the worst (5): p5 is
    shed. p9 is worse than the worst now (4): refused. p4b equals it: refused (strictly
    better only). p1 is better: p4 is shed. The next step ends p5 and p4 with "shed"."""
    engine = make(tiny_model, "priority", max_waiting_requests=2)
    for name, priority in [("p5", 5), ("p3", 3), ("p4", 4), ("p9", 9), ("p4b", 4), ("p1", 1)]:
        try:
            engine.add_request(name, prompt(4, 10 * priority), PARAMS, priority=priority)
        except QueueFullError:
            assert name in ("p9", "p4b")
    assert sorted(engine.requests) == ["p1", "p3"]
    assert _shed_counts(engine) == {"displaced": 2, "queue_full": 2}
    reasons = _final_reasons(engine)
    assert reasons == {"p5": "shed", "p4": "shed"}
    assert finish_order(engine) == ["p1", "p3"]


@pytest.mark.parametrize(("now_s", "shed"), [(0.5, False), (0.5 + 1 / 128, True)])
def test_edf_sheds_a_waiting_request_that_can_no_longer_make_it(tiny_model, now_s, shed):
    """Rates 128 prefill tokens/s, 0.125 s a decode step; bound 2. e1 (32 tokens, 2 to
    generate, deadline 1 s: needs 0.25 + 0.25 = 0.5 s) and e2 (no deadline) wait. At 0.5 s e1
    can still just make it (0.5 + 0.5 <= 1.0): the newcomer e3 is refused; 1/128 s later it
    cannot: e1 is shed ("infeasible_shed") and e3 admitted."""
    clock = ManualClock()
    rates = StepRates(prefill_tokens_per_s=128.0, decode_step_s=0.125, alpha=0.0)
    engine = make(tiny_model, "edf", clock=clock, rates=rates, max_waiting_requests=2)
    engine.add_request("e1", prompt(32, 0), PARAMS, deadline_ms=1000)
    engine.add_request("e2", prompt(32, 100), PARAMS)
    clock.now_s = now_s
    if not shed:
        with pytest.raises(QueueFullError) as refused:
            engine.add_request("e3", prompt(32, 200), PARAMS, deadline_ms=5000)
        assert not isinstance(refused.value, DeadlineInfeasibleError)
        assert _shed_counts(engine) == {"queue_full": 1}
        return
    engine.add_request("e3", prompt(32, 200), PARAMS, deadline_ms=5000)
    assert _shed_counts(engine) == {"infeasible_shed": 1}
    assert _final_reasons(engine) == {"e1": "shed"}
    assert finish_order(engine) == ["e3", "e2"]


def test_fair_sheds_the_heaviest_tenants_latest_waiting_request(tiny_model):
    """Bound 2. a1 runs alone first (A's counter 6: 4 prompt + 1 output position x 2). a2,
    a3 wait. a4 (A): the heaviest waiting tenant is its own: refused. b1 (B, counter 0): A's
    6 is larger, so A's latest waiting request a3 is shed and b1 admitted (B lifted to 6 on
    arrival). a5 (A): the heaviest waiting, ties broken by latest arrival, is b1's B at 6,
    not larger than A's 6: refused."""
    engine = make(tiny_model, "fair", max_waiting_requests=2)
    engine.add_request("a1", prompt(4, 0), PARAMS, tenant="A")
    assert finish_order(engine) == ["a1"]
    for name in ("a2", "a3", "a4", "b1", "a5"):
        try:
            engine.add_request(name, prompt(4, 10 * int(name[1])), PARAMS, tenant=name[0].upper())
        except QueueFullError:
            assert name in ("a4", "a5")
    assert sorted(engine.requests) == ["a2", "b1"]
    assert _shed_counts(engine) == {"displaced": 1, "queue_full": 2}
    assert _final_reasons(engine) == {"a3": "shed"}
    assert finish_order(engine) == ["a2", "b1"]


@pytest.mark.parametrize("policy", ["priority", "fcfs", "edf"])
def test_the_queue_memory_stays_bounded_under_churn(tiny_model, policy):
    """1,000 requests with deadlines come and go while nothing steps: under priority each
    newcomer is better than the worst waiting one and sheds it, under fcfs and edf each is
    aborted while it waits. The waiting queue's entries and the deadline heap (ended ones are
    dropped once they are the majority) stay within 2 x bound + 64 + 1; only the counts
    grow."""
    engine = make(tiny_model, policy, max_waiting_requests=2)
    largest = 0
    for i in range(1000):
        engine.add_request(f"r{i}", prompt(4, i), PARAMS, priority=-i, deadline_ms=10**9)
        if policy != "priority":
            engine.abort(f"r{i}")
        largest = max(largest, len(engine.scheduler._waiting), len(engine.overload._deadlines))
    assert largest <= 2 * 2 + 64 + 1
    assert len(engine.requests) == (2 if policy == "priority" else 0)
    assert _shed_counts(engine) == ({"displaced": 998} if policy == "priority" else {})


def test_a_deadline_added_as_the_heap_is_compacted_still_ends_its_request(tiny_model):
    """64 requests with deadlines added and aborted leave 64 ended entries in the deadline
    heap, at its threshold (2 x 0 live + 64); the next one takes it past. Compacting then must
    keep the newcomer's own deadline, though the engine lists the request only once it is
    admitted."""
    clock = ManualClock()
    engine = make(tiny_model, "fcfs", clock=clock)
    for i in range(64):
        engine.add_request(f"r{i}", prompt(4, i), PARAMS, deadline_ms=10**6)
        engine.abort(f"r{i}")
    engine.add_request("last", prompt(4, 0), PARAMS, deadline_ms=500)
    clock.now_s = 0.501
    assert _final_reasons(engine)["last"] == "deadline"


def test_every_reason_is_counted_from_zero(tiny_model):
    assert make(tiny_model).stats().requests_shed_by_reason == dict.fromkeys(SHED_REASONS, 0)


def test_shedding_over_http(tiny_model):
    """priority, one seat, bound 1, every step 50 ms slower. r1 (priority 2) runs; r2
    (priority 5) waits; r3 (priority 3, better than r2's 5) finds the queue full: r2 is shed
    (non-streamed: 429 `request_shed`) and r3 queued. r4 (priority 9) is refused (429
    `rate_limit_exceeded`). /metrics counts each by reason and shows the waiting queue."""
    from server_fixtures import metric, running_server, scrape, wait_until

    from engine_ref.serving.engine_thread import ThreadEngineLoop
    from engine_ref.serving.server import ServerConfig

    engine = make(tiny_model, "priority", max_waiting_requests=1)
    config = ServerConfig(port=0, enable_fault_injection=True)
    with running_server(config, engine_loop=ThreadEngineLoop(engine)) as url:

        def gauges() -> tuple[float, float]:
            text = scrape(url)
            return metric(text, "vllm:num_requests_running"), metric(
                text, "vllm:num_requests_waiting"
            )

        results = asyncio.run(_shed_scenario(url, gauges, wait_until))
        text = scrape(url)
    assert results["r2"][0] == 429 and results["r2"][1]["error"]["code"] == "request_shed"
    assert results["r4"][0] == 429 and results["r4"][1]["error"]["code"] == "rate_limit_exceeded"
    assert results["r3"][0] == 200
    shed = "vllm:request_shed_total"
    assert metric(text, shed, reason="displaced") == 1
    assert metric(text, shed, reason="queue_full") == 1
    assert metric(text, shed, reason="deadline_missed") == 0
    assert metric(text, "vllm:request_rejected_total") == 2
    assert metric(text, "vllm:request_success_total", finished_reason="shed") == 1


async def _shed_scenario(url, gauges, wait_until) -> dict[str, tuple[int, dict]]:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:

        async def post(priority: int, **extra):
            async with session.post(
                url + "/v1/completions", json={**body, **extra, "priority": priority}
            ) as response:
                return response.status, await response.json()

        async with session.post(url + "/admin/step_delay", json={"delay_ms": 50}) as response:
            assert response.status == 200
        r1 = asyncio.create_task(post(2, max_tokens=40))
        assert await asyncio.to_thread(wait_until, lambda: gauges() == (1, 0), timeout_s=30)
        r2 = asyncio.create_task(post(5))
        assert await asyncio.to_thread(wait_until, lambda: gauges() == (1, 1), timeout_s=30)
        r3 = asyncio.create_task(post(3))
        r2_result = await r2
        r4_result = await post(9)
        async with session.post(url + "/admin/step_delay", json={"delay_ms": 0}) as response:
            assert response.status == 200
        return {"r2": r2_result, "r3": await r3, "r4": r4_result, "r1": await r1}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scheduling-policy", "lottery"], "Unknown scheduling_policy 'lottery'; use fcfs, "),
        (["--priority-aging-steps", "-1"], "priority_aging_steps must be at least 0, got -1."),
        (["--affinity-max-bypass", "-2"], "affinity_max_bypass must be at least 0, got -2."),
        (["--affinity-max-bypass", "many"], "'many' is not a valid integer"),
    ],
)
def test_bad_policy_options_are_one_sentence_and_exit_code_2(args, message):
    from engine_ref.serving.cli_serve import serve

    result = CliRunner().invoke(serve, ["--model", "tiny-random", *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_the_new_options_are_listed_by_the_cli():
    from engine_ref.serving.cli_serve import serve

    text = CliRunner().invoke(serve, ["--help"]).output
    assert "--priority-aging-steps" in text and "--affinity-max-bypass" in text
