"""What the server survives, through HTTP against the fake engine: clients that vanish while a
multi-prompt request is being admitted, admissions that fail halfway, an engine that fails one
request, and clients that stop reading. Each ends with nothing left running in the engine and
/metrics back at idle, while other clients are served normally."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from fake_engine import FakeEngine
from server_fixtures import (
    closed_by_peer,
    connect,
    exchange,
    idle_gauges,
    is_openai_error,
    metric,
    post_bytes,
    read_head,
    running_server,
    scrape,
    wait_until,
)

from engine_ref.serving.engine_thread import ThreadEngineLoop
from engine_ref.serving.server import ServerConfig

POISON = 7  # FakeEngine fails requests whose prompt holds this token id


def _serve(engine: FakeEngine, **config):
    return running_server(ServerConfig(port=0, **config), engine_loop=ThreadEngineLoop(engine))


def _is_idle(url: str) -> bool:
    return idle_gauges(scrape(url)) == (0, 0, 0)


async def _post(url: str, body: dict) -> tuple[int, object]:
    """(status, JSON body) or, for a stream, (status, [events], "[DONE]" last if sent)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            if not body.get("stream") or response.status != 200:
                return response.status, await response.json()
            events = []
            async for line in response.content:
                if line.startswith(b"data: "):
                    payload = line[6:].strip()
                    events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
            return response.status, events


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_mid_admission_leaves_nothing_running(stream):
    # 40 prompts take 40 x 20 ms to add; the client hangs up after the first few.
    engine = FakeEngine(add_s=0.02, step_s=0.01, max_waiting=64, max_model_len=4096)
    prompts = [[5, 6, i + 8] for i in range(40)]
    body = {"prompt": prompts, "max_tokens": 2000, "stream": stream}
    with _serve(engine) as url:
        with connect(url) as sock:
            sock.sendall(post_bytes("/v1/completions", json.dumps(body).encode()))
            assert wait_until(lambda: engine.num_add_calls >= 3, timeout_s=30)
        assert wait_until(
            lambda: engine.num_add_calls == 40 and not engine.has_unfinished(), timeout_s=30
        )
        assert wait_until(lambda: _is_idle(url), timeout_s=10)
        assert engine.completed == []  # every admitted prompt was aborted, none ran on
        assert engine.num_added == len(engine.aborted) == 40
        status, answer = asyncio.run(_post(url, {"prompt": [5, 6], "max_tokens": 3}))
        assert status == 200 and answer["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    "engine, status",
    [
        (FakeEngine(fail_nth_add=3), 500),  # an unexpected error from the engine's add
        (FakeEngine(max_waiting=2), 429),  # the waiting queue fills up halfway
    ],
    ids=["add-raises", "queue-full"],
)
def test_an_admission_that_fails_halfway_aborts_the_prompts_added_before(engine, status):
    body = {"prompt": [[5, 6], [5, 7], [5, 8], [5, 9]], "max_tokens": 100}
    with _serve(engine) as url:
        got, answer = asyncio.run(_post(url, body))
        assert got == status and is_openai_error(answer)
        assert wait_until(lambda: not engine.has_unfinished(), timeout_s=10)
        assert engine.completed == [] and engine.num_added == len(engine.aborted) == 2
        assert wait_until(lambda: _is_idle(url), timeout_s=10)


def test_an_engine_failure_of_one_request_answers_500_and_the_others_carry_on():
    engine = FakeEngine(poison_token=POISON, step_s=0.005)
    healthy = {"prompt": [5, 6], "max_tokens": 20}

    async def together(url):
        return await asyncio.gather(
            _post(url, {"prompt": [5, POISON], "max_tokens": 20}),
            _post(url, {"prompt": [[5, 6], [5, POISON]], "max_tokens": 20, "n": 2}),
            _post(url, {"prompt": [5, POISON], "max_tokens": 20, "stream": True}),
            _post(url, healthy),
            _post(url, {**healthy, "stream": True}),
        )

    with _serve(engine) as url:
        errors_before = metric(scrape(url), "vllm:request_success_total", finished_reason="error")
        alone, multi, streamed, ok, ok_streamed = asyncio.run(together(url))
        text = scrape(url)
    for status, answer in (alone, multi):
        assert status == 500 and is_openai_error(answer)
        assert answer["error"]["type"] == "internal_error"
        assert "poisoned prompt" in answer["error"]["message"]
    status, events = streamed
    assert status == 200 and events[-1] == "[DONE]"
    assert is_openai_error(events[-2]) and events[-2]["error"]["type"] == "internal_error"
    assert "poisoned prompt" in events[-2]["error"]["message"]
    assert all("choices" in e for e in events[:-2])
    assert ok[0] == 200 and ok[1]["usage"]["completion_tokens"] == 20
    assert ok_streamed[0] == 200 and ok_streamed[1][-1] == "[DONE]"
    expected = ok[1]["choices"][0]["text"]
    assert "".join(e["choices"][0]["text"] for e in ok_streamed[1][:-1]) == expected
    # The healthy half of the multi-prompt request was aborted, not left running.
    assert not engine.has_unfinished() and engine.aborted
    errors = metric(text, "vllm:request_success_total", finished_reason="error")
    assert errors - errors_before == 3


def _stop_reading_after_head(url: str, body: dict):
    """A client with a tiny receive buffer that reads the response head, then nothing."""
    sock = connect(url, rcvbuf_bytes=4096)
    sock.sendall(post_bytes("/v1/completions", json.dumps(body).encode()))
    status, _, _ = read_head(sock)
    assert status == 200
    return sock


@pytest.mark.parametrize(
    "limits",
    [
        {"max_stream_backlog": 32, "stream_write_timeout_s": 60.0},
        {"max_stream_backlog": 1_000_000, "stream_write_timeout_s": 0.5},
    ],
    ids=["backlog", "write-timeout"],
)
def test_a_client_that_stops_reading_is_aborted_and_others_are_served(limits):
    engine = FakeEngine(step_s=0.002, max_model_len=1_000_000)
    # 16 samples x 50,000 tokens with logprobs: ~300 MB of events, far beyond socket buffers.
    stalled = {"prompt": [5, 6], "max_tokens": 50_000, "n": 16, "logprobs": 2, "stream": True}
    with _serve(engine, **limits) as url:
        aborts_before = metric(scrape(url), "vllm:request_success_total", finished_reason="abort")
        with _stop_reading_after_head(url, stalled) as sock:
            status, answer = asyncio.run(_post(url, {"prompt": [5, 6], "max_tokens": 30}))
            assert status == 200 and answer["usage"]["completion_tokens"] == 30
            assert wait_until(lambda: not engine.has_unfinished(), timeout_s=30)
            assert closed_by_peer(sock, timeout_s=30)
        text = scrape(url)
        assert idle_gauges(text) == (0, 0, 0)
        aborts = metric(text, "vllm:request_success_total", finished_reason="abort")
        assert aborts - aborts_before == 1
        assert len(engine.aborted) == 1 and not any(r in engine.completed for r in engine.aborted)
        status, _, answer = exchange(
            url, post_bytes("/v1/completions", b'{"prompt": [5], "max_tokens": 2}')
        )
        assert status == 200
