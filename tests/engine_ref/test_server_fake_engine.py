"""The server against a scripted fake engine with the `LLMEngine` API: wire shapes, engine
failures (500, server stays up), disconnects and admission control, deterministic and fast."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest
from fake_engine import FakeEngine
from server_fixtures import running_server

from engine_ref.serving.engine_thread import ThreadEngineLoop
from engine_ref.serving.server import ServerConfig


def _serve(engine: FakeEngine, **config):
    return running_server(ServerConfig(port=0, **config), engine_loop=ThreadEngineLoop(engine))


async def _sse_events(response: aiohttp.ClientResponse) -> list:
    """Every `data:` payload of an SSE stream, JSON-decoded except the final "[DONE]"."""
    events = []
    async for line in response.content:
        line = line.strip()
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: ") :]
        events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return events


async def _post(url: str, path: str, body: dict) -> tuple[int, dict, object]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as response:
            if body.get("stream") and response.status == 200:
                return response.status, dict(response.headers), await _sse_events(response)
            return response.status, dict(response.headers), await response.json()


def test_script_contains_split_characters():
    # The stream tests below only prove UTF-8 safety if some script token is a partial character.
    engine = FakeEngine()
    assert any("\ufffd" in engine.tokenizer.decode([t]) for t in engine.script)


def test_streamed_completion_has_openai_shapes_and_whole_characters():
    engine = FakeEngine()
    prompt = "The capital of France"
    max_tokens = len(engine.script) + 3
    body = {
        "model": "fake-model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with _serve(engine) as url:
        status, headers, events = asyncio.run(_post(url, "/v1/completions", body))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    expected_ids = [engine.script[i % len(engine.script)] for i in range(max_tokens)]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": len(engine.tokenizer.encode(prompt)),
        "completion_tokens": 2 * max_tokens,
        "total_tokens": len(engine.tokenizer.encode(prompt)) + 2 * max_tokens,
    }
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
        assert all("\ufffd" not in c["text"] for c in mine)
        assert "".join(c["text"] for c in mine) == engine.tokenizer.decode(expected_ids)
        assert [c["finish_reason"] for c in mine].count("length") == 1
        assert mine[-1]["finish_reason"] == "length"


def test_streamed_chat_opens_with_role_then_content():
    engine = FakeEngine()
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "stream": True,
        "return_token_ids": True,
    }
    with _serve(engine) as url:
        status, _, events = asyncio.run(_post(url, "/v1/chat/completions", body))
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    first = chunks[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""} and first["finish_reason"] is None
    rest = [c["choices"][0] for c in chunks[1:]]
    assert all("role" not in c["delta"] for c in rest)
    assert "".join(c["delta"].get("content", "") for c in rest) == engine.tokenizer.decode(
        engine.script[:4]
    )
    assert sum((c["token_ids"] for c in rest), []) == engine.script[:4]
    assert rest[-1]["finish_reason"] == "length"


def test_non_streaming_bodies_with_logprobs():
    engine = FakeEngine()
    with _serve(engine) as url:
        status, _, completion = asyncio.run(
            _post(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 1})
        )
        _, _, chat = asyncio.run(
            _post(
                url,
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_completion_tokens": 2,
                    "logprobs": True,
                    "top_logprobs": 2,
                },
            )
        )
    assert status == 200 and completion["object"] == "text_completion"
    choice = completion["choices"][0]
    assert choice["text"] == engine.tokenizer.decode(engine.script[:3])
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"])
    assert completion["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert chat["object"] == "chat.completion"
    message_choice = chat["choices"][0]
    assert message_choice["message"]["role"] == "assistant"
    entry = message_choice["logprobs"]["content"][0]
    assert entry["logprob"] == -0.5
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.5, -1.5]


def test_engine_failure_answers_500_and_server_keeps_serving():
    engine = FakeEngine()
    engine.fail_next_step = True
    body = {"prompt": "Hello", "max_tokens": 3}
    with _serve(engine) as url:
        status, _, failed = asyncio.run(_post(url, "/v1/completions", body))
        status_after, _, ok = asyncio.run(_post(url, "/v1/completions", body))
    assert status == 500
    assert (
        failed["error"]["type"] == "server_error"
        and "injected failure" in failed["error"]["message"]
    )
    assert status_after == 200 and ok["choices"][0]["finish_reason"] == "length"
    assert not engine.has_unfinished()


async def _hang_up_after(url: str, num_chunks: int) -> None:
    body = {"prompt": "Hello", "max_tokens": 100, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            seen = 0
            async for line in response.content:
                seen += line.startswith(b"data: ")
                if seen >= num_chunks:
                    break  # leaving the block closes the connection mid-stream


def test_client_disconnect_aborts_in_engine():
    engine = FakeEngine(step_s=0.01)
    with _serve(engine) as url:

        async def burst():
            await asyncio.gather(*(_hang_up_after(url, 3) for _ in range(5)))

        asyncio.run(burst())
        deadline = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not engine.has_unfinished()
    assert len(engine.aborted) == 5


def test_full_queue_answers_429_with_retry_after():
    engine = FakeEngine(max_running=1, max_waiting=2, step_s=0.02)
    body = {"prompt": "Hello", "max_tokens": 5}

    async def burst(url):
        return await asyncio.gather(*(_post(url, "/v1/completions", body) for _ in range(12)))

    with _serve(engine, retry_after_s=3) as url:
        results = asyncio.run(burst(url))
        after = asyncio.run(_post(url, "/v1/completions", body))
    statuses = [status for status, _, _ in results]
    assert set(statuses) == {200, 429}
    for status, headers, body_out in results:
        if status == 429:
            assert headers["Retry-After"] == "3"
            assert body_out["error"]["code"] == "rate_limit_exceeded"
    assert after[0] == 200


def test_unexpected_errors_and_unknown_routes_get_json_error_bodies():
    engine = FakeEngine()
    engine.fail_next_add = True
    body = {"prompt": "Hello", "max_tokens": 2}

    async def calls(url):
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/v1/nothing") as response:
                missing = response.status, await response.json()
            async with session.get(url + "/v1/completions") as response:
                wrong_method = response.status, await response.json()
        return missing, wrong_method

    with _serve(engine) as url:
        status, _, failed = asyncio.run(_post(url, "/v1/completions", body))
        missing, wrong_method = asyncio.run(calls(url))
        status_after, _, _ = asyncio.run(_post(url, "/v1/completions", body))
    assert status == 500 and "unexpected bug" in failed["error"]["message"]
    assert failed["error"]["type"] == "server_error"
    assert missing[0] == 404 and missing[1]["error"]["type"] == "invalid_request_error"
    assert wrong_method[0] == 405 and "error" in wrong_method[1]
    assert status_after == 200


def test_non_streaming_client_that_gives_up_is_aborted():
    engine = FakeEngine(step_s=0.01)
    body = {"prompt": "Hello", "max_tokens": 120}

    async def impatient(url):
        timeout = aiohttp.ClientTimeout(total=0.3)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            with pytest.raises(asyncio.TimeoutError):
                async with session.post(url + "/v1/completions", json=body) as response:
                    await response.read()

    with _serve(engine) as url:
        asyncio.run(impatient(url))
        deadline = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not engine.has_unfinished()
    assert len(engine.aborted) == 1


def test_engine_loop_waits_instead_of_spinning_while_the_engine_is_stalled():
    engine = FakeEngine()
    engine.stalled = True
    body = {"prompt": "Hello", "max_tokens": 3}

    async def stalled_then_released(url):
        request = asyncio.ensure_future(_post(url, "/v1/completions", body))
        await asyncio.sleep(0.5)
        calls_while_stalled = engine.step_calls
        engine.stalled = False
        return calls_while_stalled, await request

    with _serve(engine) as url:
        calls, (status, _, answer) = asyncio.run(stalled_then_released(url))
    # A 5 ms wait between fruitless steps allows at most ~100 in 0.5 s; spinning makes thousands.
    assert 1 <= calls <= 150
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


class _ThreadRecordingEngine(FakeEngine):
    """Notes which threads build it and step it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.built_on = threading.get_ident()
        self.stepped_on: set[int] = set()

    def step(self):
        self.stepped_on.add(threading.get_ident())
        return super().step()


def test_engine_loop_builds_the_engine_on_the_thread_that_steps_it():
    built: list[_ThreadRecordingEngine] = []

    def build():
        built.append(_ThreadRecordingEngine())
        return built[0]

    loop = ThreadEngineLoop(build=build)
    config = ServerConfig(port=0)
    with running_server(config, engine_loop=loop) as url:
        status, _, answer = asyncio.run(
            _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        )
    assert status == 200 and answer["usage"]["completion_tokens"] == 4
    (engine,) = built
    assert engine.built_on != threading.get_ident()  # not on the test's thread
    assert engine.stepped_on == {engine.built_on}


def test_engine_build_failure_surfaces_from_server_start():
    def build():
        raise ValueError("no such model file")

    with pytest.raises(ValueError, match="no such model file"):
        with running_server(ServerConfig(port=0), engine_loop=ThreadEngineLoop(build=build)):
            pass


def test_engine_loop_takes_an_engine_or_a_build_callable_not_both():
    with pytest.raises(TypeError):
        ThreadEngineLoop(FakeEngine(), build=FakeEngine)
    with pytest.raises(TypeError):
        ThreadEngineLoop()
