"""Fuzzing the server with generated request bodies (Hypothesis) while well-formed greedy streams
run alongside, on the real tiny-random engine in a server subprocess.

Bodies for both endpoints, streaming or not, give each field wrong types, extremes (0, negative,
2**31, 2**63, 2**64, 1e20, NaN and infinities as JSON's non-standard tokens and as strings,
subnormals), huge and empty strings and lists, nesting and unknown fields; some are not JSON at
all. Asserted: no 5xx, every error answer is an OpenAI error body, every well-formed stream
produces exactly the tokens it produces alone, /health stays 200, and afterwards nothing runs
or waits and no KV block is held. The server's RSS before and after is printed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import (
    idle_gauges,
    is_openai_error,
    rss_kib,
    scrape,
    server_process,
    wait_until,
)

MAX_MODEL_LEN = 96
SERVER_ARGS = (
    "--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "16MiB",
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32",
    "--max-waiting-requests", "64", "--stream-write-timeout", "5",
)  # fmt: skip
MAX_EXAMPLES = 300
ANSWER_TIMEOUT_S = 30.0

FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature",
    "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs",
    "top_logprobs", "priority", "stream", "stream_options", "return_token_ids", "cache_salt",
    "echo", "best_of", "user", "frequency_penalty", "no_such_field",
)  # fmt: skip
EXTREMES = (
    0, -1, 1, 2, 2**31, -(2**31), 2**63, 2**63 - 1, -(2**63) - 1, 2**64, 10**30,
    1e20, -1e20, 5e-324, 2.2e-308, 1e-320, 0.5, -0.0, 1e308,
    float("nan"), float("inf"), float("-inf"), "NaN", "Infinity", "-Infinity", "1e20",
    "", "x", "a" * 100_000, [], {}, None, True, False, [[]], [None], [0] * 5000,
    ["s"] * 65, ["s" * 257], "tiny-random", "gpt-4", [{"type": "text", "text": "Hi"}],
)  # fmt: skip
SENSIBLE = {
    "prompt": st.sampled_from(["Hi", [5, 6, 7], ["a", "b"], [[5, 6], [7]], "\ud800", "東京 😀"]),
    "messages": st.sampled_from(
        [
            [{"role": "user", "content": "Hi"}],
            [{"role": "system", "content": ""}, {"role": "user", "content": [{"type": "text"}]}],
            [{"role": "tool", "content": None}],
            [{"role": 5, "content": "x"}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        ]
    ),
    "max_tokens": st.integers(-2, MAX_MODEL_LEN + 2),
    "n": st.integers(-1, 40),
    "temperature": st.floats(-1, 3, allow_nan=False),
    "stream_options": st.sampled_from([{"include_usage": True}, {"include_usage": "yes"}, []]),
    "stream": st.booleans(),
    "logprobs": st.integers(-1, 21) | st.booleans(),
    "top_logprobs": st.integers(-1, 21),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "seed": st.integers(-(2**63), 2**63 - 1),
}
json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
weird = st.sampled_from(EXTREMES) | json_values


@st.composite
def request_bodies(draw) -> tuple[str, bytes]:
    """(path, raw body): mostly a JSON object with mutated fields, sometimes not JSON at all."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    kind = draw(st.sampled_from(["fields"] * 8 + ["nested", "raw"]))
    if kind == "nested":
        depth = draw(st.sampled_from([50, 900, 5_000, 100_000]))
        inner = b"[" * depth + b"]" * depth
        return path, draw(st.sampled_from([inner, b'{"prompt": ' + inner + b"}"]))
    if kind == "raw":
        raw = draw(st.binary(max_size=64) | st.sampled_from([b"", b"{", b"[1,2]", b'"x"', b"null"]))
        return path, raw
    body: dict = {"max_tokens": 4, "stream": draw(st.booleans())}
    body["prompt" if path == "/v1/completions" else "messages"] = (
        "Hi" if path == "/v1/completions" else [{"role": "user", "content": "Hi"}]
    )
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        sensible = SENSIBLE.get(name)
        body[name] = draw(weird if sensible is None else weird | sensible)
    return path, json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


async def _send(session: aiohttp.ClientSession, url: str, path: str, raw: bytes) -> None:
    """Send one fuzzed body; assert the answer is not a 5xx and an error is an OpenAI body.
    A stream that starts is read a little, then dropped (the server must abort it)."""
    headers = {"Content-Type": "application/json"}
    async with session.post(url + path, data=raw, headers=headers) as response:
        assert response.status < 500, (response.status, await response.text(), raw[:300])
        if response.status != 200:
            body = await response.json(content_type=None)
            assert is_openai_error(body), (response.status, body)
            return
        if not response.headers["Content-Type"].startswith("text/event-stream"):
            body = await response.json()
            assert "choices" in body and "usage" in body
            return
        lines = 0
        async for line in response.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                lines += 1
            if lines >= 4:
                break


REFERENCE_PROMPTS = ([5, 6, 7, 8], [100, 3, 77], [9] * 20, [300, 301, 302, 303, 304, 305])


def _greedy_body(prompt: list[int]) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


async def _greedy_tokens(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> list:
    tokens: list[int] = []
    async with session.post(url + "/v1/completions", json=_greedy_body(prompt)) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                tokens += event["choices"][0]["token_ids"]
    return tokens


class _GreedyLoad:
    """Well-formed greedy streams (and /health) on a thread of its own until `stop()`: each
    stream's tokens are compared with what the same request produced alone."""

    def __init__(self, url: str, references: dict[tuple[int, ...], list[int]]) -> None:
        self.url = url
        self.references = references
        self.completed = 0
        self.mismatches: list = []
        self.health: list[int] = []
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> _GreedyLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._errors, self._errors

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._errors.append(exc)

    async def _main(self) -> None:
        timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._worker(session, i) for i in range(3)), self._poll(session))

    async def _worker(self, session: aiohttp.ClientSession, offset: int) -> None:
        prompts = list(self.references)
        i = offset
        while not self._stop.is_set():
            prompt = prompts[i % len(prompts)]
            tokens = await _greedy_tokens(session, self.url, list(prompt))
            if tokens != self.references[prompt]:
                self.mismatches.append((prompt, tokens, self.references[prompt]))
            self.completed += 1
            i += 1

    async def _poll(self, session: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            async with session.get(self.url + "/health") as response:
                self.health.append(response.status)
            await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    with server_process(tmp_path_factory.mktemp("fuzz-server"), *SERVER_ARGS) as (url, pid):
        yield url, pid


@pytest.mark.slow
def test_fuzzed_bodies_never_get_a_5xx_nor_disturb_greedy_streams(fuzz_server):
    url, pid = fuzz_server

    async def alone() -> dict:
        async with aiohttp.ClientSession() as session:
            return {tuple(p): await _greedy_tokens(session, url, p) for p in REFERENCE_PROMPTS}

    references = asyncio.run(alone())
    assert all(len(tokens) == 16 for tokens in references.values())
    idle_blocks = idle_gauges(scrape(url))[2]
    rss_before_kib = rss_kib(pid)
    examples = []

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(request_bodies(), min_size=1, max_size=3))
    def fuzz(batch):
        async def send_all():
            timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                await asyncio.gather(*(_send(session, url, path, raw) for path, raw in batch))

        asyncio.run(send_all())
        examples.append(len(batch))

    t0_s = time.monotonic()
    with _GreedyLoad(url, references) as load:
        fuzz()
    elapsed_s = time.monotonic() - t0_s
    assert load.completed > 0 and load.mismatches == []
    assert load.health and set(load.health) == {200}
    assert wait_until(lambda: idle_gauges(scrape(url)) == (0, 0, idle_blocks), timeout_s=60)
    rss_after_kib = rss_kib(pid)
    print(
        f"\nfuzz: {len(examples)} examples ({sum(examples)} bodies) in {elapsed_s:.1f} s "
        f"alongside {load.completed} greedy streams; server RSS {rss_before_kib / 1024:.1f} MiB "
        f"before, {rss_after_kib / 1024:.1f} MiB after "
        f"({100 * (rss_after_kib - rss_before_kib) / rss_before_kib:+.1f}%)"
    )
