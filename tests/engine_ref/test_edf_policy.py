"""The `edf` policy and deadlines through `LLMEngine.step` and over HTTP: the order of the
waiting queue, the preemption victim, the admission estimate worked by hand from injected
rates, late requests ended with finish_reason "deadline", and the `x-request-deadline-ms`
header.

Rates in the admission cases are powers of two, so every sum below is exact: prefill 128
tokens/s (128 tokens take 1 s) and 0.125 s per decode step."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from policy_util import PARAMS, ManualClock, StepClock, finish_order, make, post, prompt

from engine_ref import EngineError, SamplingParams
from engine_ref.core.overload import DeadlineInfeasibleError
from engine_ref.core.sequence import SequenceStatus
from engine_ref.core.step_meter import StepRates

RATES = dict(prefill_tokens_per_s=128.0, decode_step_s=0.125, alpha=0.0)


def test_waiting_queue_is_ordered_by_deadline_then_none_then_arrival(tiny_model):
    engine = make(tiny_model, "edf", clock=ManualClock())
    for name, deadline_ms in [("late", 9000), ("none1", None), ("early", 5000),
                              ("none2", None), ("mid", 7000), ("mid2", 7000)]:  # fmt: skip
        engine.add_request(name, prompt(4, len(name)), PARAMS, deadline_ms=deadline_ms)
    assert finish_order(engine) == ["early", "mid", "mid2", "late", "none1", "none2"]


@pytest.mark.parametrize(("policy", "victim"), [("edf", "a"), ("fcfs", "c")])
def test_preemption_takes_the_latest_deadline_first(tiny_model, policy, victim):
    """6 blocks of 4 tokens; three 7-token prompts take 2 blocks each. Step 1 prefills all
    (8 tokens each), step 2 decodes position 7 (still the second block), step 3 needs a third
    block for each and there is none: the decode rows go in key order (b 1 s, c 2 s, a 3 s)
    and b's block comes from the largest key, a (the latest deadline); fcfs takes c (the
    latest arrival)."""
    engine = make(tiny_model, policy, clock=ManualClock(), num_blocks=6, block_size=4,
                  max_num_seqs=3)  # fmt: skip
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for name, deadline_ms in (("a", 3000), ("b", 1000), ("c", 2000)):
        engine.add_request(name, prompt(7, ord(name) * 7), params, deadline_ms=deadline_ms)
    for _ in range(3):
        engine.step()
    seqs = {name: engine.requests[name].sequences[0] for name in "abc"}
    assert [n for n, s in seqs.items() if s.status is SequenceStatus.WAITING] == [victim]
    assert engine.stats().num_preemptions == 1
    assert sorted(finish_order(engine)) == ["a", "b", "c"]


def _add(engine, name, prompt_len, max_tokens, deadline_ms):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request(name, prompt(prompt_len, 40 * len(engine.requests)), params,
                       deadline_ms=deadline_ms)  # fmt: skip


def test_admission_refuses_exactly_the_infeasible_by_hand(tiny_model):
    """At time 0, estimate = (tokens ahead + prompt) / 128 + max_tokens x 0.125 s, "ahead"
    being the waiting requests with a deadline no later than the newcomer's:
    - r1: 128 tokens (1 s) + 4 steps (0.5 s) = 1.5 s <= 1.5 s: admitted (at the bound).
    - r2: r1 ahead (1 s) + 64 tokens (0.5 s) + 16 steps (2 s) = 3.5 s > 2.499 s: refused;
      even alone 2.5 s > 2.499 s (just below), so the reason says so; Retry-After ceil(1 s).
    - r3: r1 ahead (1 s) + 256 tokens (2 s) + 2 steps (0.25 s) = 3.25 s <= 3.251 s: admitted
      (just above).
    - r4: r1 ahead (1 s; its 1.5 s deadline ties, and counts) + 32 tokens (0.25 s) + 2 steps
      (0.25 s) = 1.5 s <= 1.5 s: admitted; r3 (3.251 s) is not ahead of it.
    - r5: r1, r4 and r3 ahead (1 + 0.25 + 2 = 3.25 s) + 32 tokens (0.25 s) + 2 steps
      (0.25 s) = 3.75 s > 3.499 s: refused because of the queue (alone 0.5 s); Retry-After
      ceil(3.25 s) = 4.
    - r6: no deadline: admitted unchecked.
    Then, one at a time by deadline: r1, r4 (tie, later arrival), r3, r6."""
    engine = make(tiny_model, "edf", clock=ManualClock(), rates=StepRates(**RATES))
    refused = {}
    for name, prompt_len, max_tokens, deadline_ms in [
        ("r1", 128, 4, 1500), ("r2", 64, 16, 2499), ("r3", 256, 2, 3251),
        ("r4", 32, 2, 1500), ("r5", 32, 2, 3499), ("r6", 32, 2, None),
    ]:  # fmt: skip
        try:
            _add(engine, name, prompt_len, max_tokens, deadline_ms)
        except DeadlineInfeasibleError as exc:
            refused[name] = exc
    assert sorted(refused) == ["r2", "r5"]
    assert str(refused["r2"]) == (
        "The deadline of 2499 ms cannot be met: this engine estimates 3500 ms at its measured "
        "speed (even with nothing queued ahead of it); allow more time, ask for fewer tokens, "
        "or retry later."
    )
    assert "estimates 3750 ms" in str(refused["r5"])
    assert "(3250 ms of it prefilling the requests queued ahead)" in str(refused["r5"])
    assert [refused["r2"].retry_after_s, refused["r5"].retry_after_s] == [1, 4]
    assert engine.stats().requests_shed_by_reason["deadline_infeasible"] == 2
    assert sorted(engine.requests) == ["r1", "r3", "r4", "r6"]
    assert finish_order(engine) == ["r1", "r4", "r3", "r6"]


def test_before_any_rate_is_measured_everything_is_admitted(tiny_model):
    engine = make(tiny_model, "edf", clock=ManualClock())
    _add(engine, "r1", 256, 1000, 1)  # 1 ms for 256 + 1000 tokens: admitted, unmeasured
    assert "r1" in engine.requests


def test_late_requests_end_with_finish_reason_deadline_keeping_their_tokens(tiny_model):
    """fcfs, one at a time: a (deadline 1 s, runs), b (0.5 s, waits behind a), c (none).
    Steps at t = 0, 0.4, 0.6, 1.0, 1.001: at 0.6 b's deadline has passed (it ends with no
    token); at 1.0 a's has not (it is not past; a decodes a 4th token); at 1.001 it has, and a
    ends keeping its 4 tokens, and c takes its seat in that same step."""
    clock = ManualClock()
    engine = make(tiny_model, "fcfs", clock=clock)
    long = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request("a", prompt(4, 0), long, deadline_ms=1000)
    engine.add_request("b", prompt(4, 50), long, deadline_ms=500)
    engine.add_request("c", prompt(4, 100), PARAMS)
    finals = {}
    tokens: dict[str, int] = {}
    for now_s in (0.0, 0.4, 0.6, 1.0, 1.001):
        clock.now_s = now_s
        for out in engine.step():
            for completion in out.outputs:
                tokens[out.request_id] = tokens.get(out.request_id, 0) + len(
                    completion.new_token_ids
                )
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert finals["b"].finish_reason == "deadline" and finals["b"].num_output_tokens == 0
    assert finals["a"].finish_reason == "deadline" and finals["a"].num_output_tokens == 4
    assert tokens == {"a": 4, "b": 0, "c": 1}  # c took a's seat in the step that ended a
    assert finish_order(engine) == ["c"]
    stats = engine.stats()
    assert stats.requests_shed_by_reason["deadline_missed"] == 2
    assert stats.num_blocks_used == 0


@pytest.mark.parametrize("deadline_ms", [0, -1, 1.5, True, "100", 10**12 + 1])
def test_a_bad_deadline_is_one_sentence(tiny_model, deadline_ms):
    engine = make(tiny_model, "edf")
    with pytest.raises(EngineError, match=r"^deadline_ms must be a whole number of milliseconds"):
        engine.add_request("a", prompt(4, 0), PARAMS, deadline_ms=deadline_ms)
    engine.add_request("b", prompt(4, 0), PARAMS, deadline_ms=1)  # the bounds
    engine.add_request("c", prompt(4, 0), PARAMS, deadline_ms=10**12)


def _server(engine):
    from server_fixtures import running_server

    from engine_ref.serving.engine_thread import ThreadEngineLoop
    from engine_ref.serving.server import ServerConfig

    return running_server(ServerConfig(port=0), engine_loop=ThreadEngineLoop(engine))


BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True, "temperature": 0}


@pytest.mark.parametrize("header", ["0", "-5", "1.5", "soon", "", "9" * 14, "10000000000001"])
def test_a_bad_deadline_header_is_a_400_in_one_sentence(tiny_model, header):
    from server_fixtures import exchange

    with _server(make(tiny_model)) as url:
        request = post("/v1/completions", BODY, {"x-request-deadline-ms": header})
        status, _, answer = exchange(url, request)
    assert status == 400, answer
    assert answer["error"]["param"] == "x-request-deadline-ms"
    assert answer["error"]["message"].startswith(
        "The x-request-deadline-ms header must be a whole number of milliseconds from 1 to "
        "1000000000000, got "
    )


def test_deadlines_over_http(tiny_model):
    """Engine time moves 0.1 s per step (`StepClock`); the engine believes in 128 prefill
    tokens/s and 1/128 s per decode step. A 4-token prompt with 8 tokens to generate needs
    12/128 s = 93.75 ms: 93 ms is refused (429, the reason in the body, Retry-After 1: nothing
    queued ahead); 1000 ms is admitted and done ("length") in 8 steps (0.8 s). A 50-token
    request (54/128 s = 421.875 ms) with 450 ms is admitted, and its deadline passes at the
    6th step (0.5 s): it ends with finish_reason "deadline" and the 5 tokens of the first 5
    steps, non-streamed (a 200) and streamed (the last chunk). /metrics counts by reason."""
    from server_fixtures import exchange, metric, scrape

    clock = StepClock(0.1)
    rates = StepRates(prefill_tokens_per_s=128.0, decode_step_s=1 / 128, alpha=0.0)
    engine = clock.drive(make(tiny_model, "edf", clock=clock, rates=rates))
    with _server(engine) as url:
        status, headers, answer = exchange(
            url, post("/v1/completions", BODY, {"x-request-deadline-ms": "93"})
        )
        assert status == 429 and headers["retry-after"] == "1"
        assert answer["error"]["code"] == "deadline_infeasible"
        assert answer["error"]["message"] == (
            "The deadline of 93 ms cannot be met: this engine estimates 94 ms at its measured "
            "speed (even with nothing queued ahead of it); allow more time, ask for fewer "
            "tokens, or retry later."
        )
        status, _, answer = exchange(
            url, post("/v1/completions", BODY, {"x-request-deadline-ms": "1000"})
        )
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
        late = {**BODY, "max_tokens": 50}
        status, _, answer = exchange(
            url, post("/v1/completions", late, {"x-request-deadline-ms": "450"})
        )
        assert status == 200
        assert answer["choices"][0]["finish_reason"] == "deadline"
        assert answer["usage"]["completion_tokens"] == 5
        body = {**late, "stream": True, "return_token_ids": True}
        chunks = [c["choices"][0] for c in asyncio.run(_stream(url, body, "450")) if c["choices"]]
        assert [c["finish_reason"] for c in chunks][-1] == "deadline"
        assert sum(len(c.get("token_ids") or ()) for c in chunks) == 5
        text = scrape(url)
        shed = "vllm:request_shed_total"
        assert metric(text, shed, reason="deadline_infeasible") == 1
        assert metric(text, shed, reason="deadline_missed") == 2
        assert metric(text, "vllm:request_success_total", finished_reason="deadline") == 2


async def _stream(url: str, body: dict, deadline_ms: str) -> list[dict]:
    import json

    chunks = []
    async with aiohttp.ClientSession() as session:
        headers = {"x-request-deadline-ms": deadline_ms}
        async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
            assert response.status == 200
            async for line in response.content:
                text = line.decode().strip()
                if text.startswith("data: {"):
                    chunks.append(json.loads(text[len("data: ") :]))
    return chunks
