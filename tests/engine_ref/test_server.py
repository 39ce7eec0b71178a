"""Acceptance tests of the reference server on the real engine with tiny-random: the official
`openai` client, bad requests, client disconnects, admission control and UTF-8 safe streams."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import urllib.request

import aiohttp
import openai
import pytest
from server_fixtures import running_server

from engine_ref.core import kernels
from engine_ref.core.engine_config import EngineConfig
from engine_ref.serving.server import ServerConfig

MODEL = "tiny-random"
# 512 blocks of 16 tokens: plenty for these tests, and a small allocation.
SMALL_KV_BYTES = 512 * 16 * 1024


def _config(engine_loop: str = "thread", **engine_overrides) -> ServerConfig:
    engine = EngineConfig(
        model=MODEL,
        dtype="float32",
        device="cpu",
        num_threads=1,
        kv_cache_memory_bytes=SMALL_KV_BYTES,
        **engine_overrides,
    )
    return ServerConfig(engine=engine, port=0, engine_loop=engine_loop)


# The process mode spawns an engine process that imports torch afresh (~5 s): slow tests only.
LOOP_MODES = ["thread", pytest.param("process", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=LOOP_MODES)
def server_url(request):
    with running_server(_config(request.param)) as url:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text; labels given must all match."""
    for line in text.splitlines():
        match = re.fullmatch(r"([^\s{]+)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    raise AssertionError(f"metric {name} {labels} not found")


async def _get_text(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as response:
            assert response.status == 200
            return await response.text()


def _scrape(url: str) -> str:
    return asyncio.run(_get_text(url + "/metrics"))


def test_openai_client_completions(server_url):
    client = _client(server_url)
    result = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "text_completion" and result.model == MODEL
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 5
    stream = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == result.choices[0].text  # greedy: streaming and not agree
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_client_chat(server_url):
    client = _client(server_url)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    result = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == result.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == result.usage.prompt_tokens
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_seeded_sampling_with_n_and_logprobs(server_url):
    client = _client(server_url)
    kwargs = dict(
        model=MODEL,
        prompt="Hello",
        max_tokens=8,
        temperature=5.0,
        seed=7,
        n=2,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert sorted(c.index for c in first.choices) == [0, 1]
    for choice in first.choices:
        assert len(choice.logprobs.token_logprobs) == 8
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert first.usage.completion_tokens == 16


async def _raw_post(url: str, data: bytes) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            url, data=data, headers={"Content-Type": "application/json"}
        ) as response:
            return response.status, await response.json()


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "tiny-random", "prompt": "hi"', 400),  # malformed JSON
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}', 400),  # wrong type
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 9000}', 400),  # beyond the 8192 context
    ("/v1/completions", b'{"prompt": "hi", "model": "gpt-4"}', 404),  # unknown model
    ("/v1/chat/completions", b'{"model": "tiny-random", "messages": []}', 400),
    ("/v1/completions", b'{"prompt": "caf\xc3"}', 400),  # invalid UTF-8
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400),  # a lone surrogate
    ("/v1/completions", b'{"prompt": ""}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400),
    # Beam search with what it does not take, and best_of without it.
    ("/v1/completions", b'{"prompt": "hi", "use_beam_search": true, "stop": ["x"]}', 400),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "best_of": 2}',
        400,
    ),
]


def test_bad_requests_get_openai_errors_then_a_request_succeeds(server_url):
    for path, data, status in BAD_REQUESTS:
        got, body = asyncio.run(_raw_post(server_url + path, data))
        assert got == status, (data, body)
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and error["type"] == "invalid_request_error"
    result = _client(server_url).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert result.choices[0].text is not None and result.usage.completion_tokens >= 1


def test_beam_search_over_http_streamed_and_not(server_url):
    """The n best beams, each whole; streamed they arrive at the end with the same texts."""
    body = dict(model=MODEL, prompt="Hello there", max_tokens=6, n=2,
                extra_body={"use_beam_search": True, "best_of": 3, "ignore_eos": True})  # fmt: skip
    client = _client(server_url)
    result = client.completions.create(**body)
    texts = [c.text for c in sorted(result.choices, key=lambda c: c.index)]
    assert len(texts) == 2 and texts[0] != texts[1]
    assert {c.finish_reason for c in result.choices} == {"length"}
    assert result.usage.completion_tokens == 12
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**body, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[0], streamed[1]] == texts


async def _stream_then_hang_up(url: str, num_tokens: int) -> int:
    body = {
        "model": MODEL,
        "prompt": "Hello there",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    seen = 0
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: {"):
                    seen += len(json.loads(line[6:])["choices"][0]["token_ids"])
                if seen >= num_tokens:
                    break  # leaving the session closes the connection mid-stream
    return seen


def test_disconnects_free_requests_and_kv_blocks(server_url):
    before = _scrape(server_url)
    idle_blocks = _metric(before, "vllm:kv_cache_blocks_used", model_name=MODEL)
    aborted_before = _metric(before, "vllm:request_success_total", finished_reason="abort")

    async def clients():
        return await asyncio.gather(*(_stream_then_hang_up(server_url, 3) for _ in range(20)))

    assert all(seen >= 3 for seen in asyncio.run(clients()))
    deadline = time.monotonic() + 20
    while True:
        text = _scrape(server_url)
        running = _metric(text, "vllm:num_requests_running", model_name=MODEL)
        waiting = _metric(text, "vllm:num_requests_waiting", model_name=MODEL)
        used = _metric(text, "vllm:kv_cache_blocks_used", model_name=MODEL)
        if (running, waiting, used) == (0, 0, idle_blocks) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (running, waiting, used) == (0, 0, idle_blocks)
    aborted = _metric(text, "vllm:request_success_total", finished_reason="abort")
    assert aborted - aborted_before == 20


def test_metrics_count_tokens_and_latencies(server_url):
    before = _scrape(server_url)
    client = _client(server_url)
    client.completions.create(
        model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, extra_body={"ignore_eos": True}
    )
    after = _scrape(server_url)

    def delta(name, **labels):
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("vllm:generation_tokens_total", model_name=MODEL) == 4
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count", model_name=MODEL) == 1
    assert delta("vllm:inter_token_latency_seconds_count", model_name=MODEL) == 3
    assert delta("vllm:e2e_request_latency_seconds_count", model_name=MODEL) == 1
    assert 0 < delta("vllm:prompt_tokens_total", model_name=MODEL) <= 4
    assert delta("vllm:request_time_per_output_token_seconds_count", model_name=MODEL) == 1
    assert delta("vllm:request_prompt_tokens_sum", model_name=MODEL) == 4
    assert delta("vllm:request_generation_tokens_sum", model_name=MODEL) == 4


def test_streams_never_split_utf8_characters(server_url):
    # Near-uniform sampling over a byte-level vocabulary emits partial-character tokens.
    async def one(seed):
        body = {
            "model": MODEL,
            "prompt": "東京 😀 Café",
            "max_tokens": 48,
            "temperature": 100.0,
            "seed": seed,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        texts, ids = [], []
        async with aiohttp.ClientSession() as session:
            async with session.post(server_url + "/v1/completions", json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        texts.append(choice["text"])
                        ids.extend(choice["token_ids"])
        return texts, ids

    async def all_seeds():
        return await asyncio.gather(*(one(seed) for seed in range(6)))

    from engine_ref.loading.tiny_random import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    split_characters = 0
    for texts, ids in asyncio.run(all_seeds()):
        # A character split across chunks would reach the client as U+FFFD pieces, so the
        # joined chunks would differ from decoding all the ids at once.
        assert "".join(texts) == tokenizer.decode(ids)
        for k in range(1, len(ids)):
            head, longer = tokenizer.decode(ids[:k]), tokenizer.decode(ids[: k + 1])
            split_characters += head.endswith("\ufffd") and not longer.startswith(head)
    # The case is exercised: some character's bytes came in two or more tokens.
    assert split_characters > 0


@pytest.mark.parametrize("engine_loop", LOOP_MODES)
def test_full_waiting_queue_answers_429_and_keeps_serving(engine_loop):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 30, "ignore_eos": True}

    async def post(url):
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json=body) as response:
                return response.status, response.headers.get("Retry-After"), await response.json()

    async def burst(url):
        return await asyncio.gather(*(post(url) for _ in range(24)))

    with running_server(_config(engine_loop, max_waiting_requests=2, max_num_seqs=2)) as url:
        results = asyncio.run(burst(url))
        statuses = sorted(status for status, _, _ in results)
        assert set(statuses) == {200, 429}, statuses
        for status, retry_after, answer in results:
            if status == 429:
                assert retry_after is not None and int(retry_after) >= 1
                assert answer["error"]["code"] == "rate_limit_exceeded"
            else:
                assert answer["usage"]["completion_tokens"] == 30
        rejected = _metric(_scrape(url), "vllm:request_rejected_total", model_name=MODEL)
        assert rejected == statuses.count(429)
        assert asyncio.run(post(url))[0] == 200


def test_stop_string_ends_the_text_before_it(server_url):
    client = _client(server_url)
    kwargs = dict(
        model=MODEL,
        prompt="The capital of France is",
        temperature=0,
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    text = client.completions.create(**kwargs).choices[0].text
    assert len(text) >= 4
    stop = text[2:4]
    stopped = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.find(stop)]


def test_info_describes_the_engine_for_manifests(server_url):
    with urllib.request.urlopen(server_url + "/info", timeout=10) as resp:
        info = json.loads(resp.read())
    assert info["engine"] == "engine_ref" and info["model"] == MODEL
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["engine_config"]["kv_cache_memory_bytes"] == SMALL_KV_BYTES
    # The kernels' level (or why they are off); the server's engine shares this process.
    assert info["kernels"] == kernels.describe() and info["kernels"] != "not loaded"


async def _completion(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            return response.status, await response.json()


def test_cache_salt_separates_prefix_caches_and_usage_reports_cached_tokens():
    config = dataclasses.replace(_config(), enable_prompt_tokens_details=True)
    prompt = list(range(10, 74))  # 64 tokens: 4 blocks of 16, 3 of them cacheable

    def cached(**salt) -> int:
        status, answer = asyncio.run(
            _completion(url, {"prompt": prompt, "max_tokens": 1, "temperature": 0, **salt})
        )
        assert status == 200, answer
        assert answer["usage"]["prompt_tokens"] == len(prompt)
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    with running_server(config) as url:
        assert cached(cache_salt="tenant-a") == 0  # nothing cached yet
        assert cached(cache_salt="tenant-b") == 0  # same prompt, other salt: no sharing
        assert cached() == 0  # no salt is a salt of its own
        assert cached(cache_salt="tenant-a") == 48  # same salt: the three full blocks
        assert cached() == 48
        for bad in (5, "", "s" * 1025):
            status, answer = asyncio.run(_completion(url, {"prompt": prompt, "cache_salt": bad}))
            assert status == 400 and answer["error"]["param"] == "cache_salt"
        stream = _client(url).completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": "tenant-b"},
        )
        usage = list(stream)[-1].usage
        assert usage.prompt_tokens_details.cached_tokens == 48


async def _post_json(url: str, path: str, body: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body) as response:
            return response.status, await response.json()


def test_step_delay_route_exists_only_with_fault_injection_and_checks_its_body():
    with running_server(_config()) as url:
        status, answer = asyncio.run(_post_json(url, "/admin/step_delay", {"delay_ms": 10}))
        assert status == 404 and "error" in answer
    config = dataclasses.replace(_config(), enable_fault_injection=True)
    bad = [{}, {"delay_ms": -1}, {"delay_ms": 60_001}, {"delay_ms": float("inf")},
           {"delay_ms": "10"}, {"delay_ms": True}, {"delay_ms": None},
           {"delay_ms": 1, "extra": 2}, [1]]  # fmt: skip
    with running_server(config) as url:
        for body in bad:
            status, answer = asyncio.run(_post_json(url, "/admin/step_delay", body))
            assert status == 400 and answer["error"]["message"].endswith("."), (body, answer)
        for edge in (0, 0.5, 60_000):
            status, answer = asyncio.run(_post_json(url, "/admin/step_delay", {"delay_ms": edge}))
            assert (status, answer) == (200, {"delay_ms": edge})

        def streamed_gaps_s() -> list[float]:
            stamps = []
            stream = _client(url).completions.create(
                model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for _ in stream:
                stamps.append(time.perf_counter())
            return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]

        asyncio.run(_post_json(url, "/admin/step_delay", {"delay_ms": 150}))
        slow = streamed_gaps_s()
        # Each step now sleeps 150 ms before its outputs are sent: no two chunks come closer.
        assert len(slow) >= 3 and min(slow) >= 0.14, slow
