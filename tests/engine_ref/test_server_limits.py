"""What a client may send, through HTTP against the fake engine: every bad body is a 4xx with an
OpenAI error body (no 500s, no plain text from aiohttp), size limits answer in well under the
time the work they bound would take while /health stays responsive, stop-string bounds name
their limit, a half-sent request head is dropped after the header timeout, and --api-key
guards /v1/* only."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
import time

import aiohttp
import pytest
from fake_engine import FakeEngine
from server_fixtures import (
    closed_by_peer,
    connect,
    exchange,
    is_openai_error,
    post_bytes,
    read_head,
    running_server,
)

from engine_ref.serving.engine_thread import ThreadEngineLoop
from engine_ref.serving.interface import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from engine_ref.serving.server import ServerConfig


def _serve(engine: FakeEngine | None = None, **config):
    loop = ThreadEngineLoop(engine or FakeEngine())
    return running_server(ServerConfig(port=0, **config), engine_loop=loop)


@pytest.fixture(scope="module")
def url():
    with _serve() as base_url:
        yield base_url


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
DEEP = 100_000
# Bodies that once answered 500 with a traceback (or that take a path near one).
BAD_BODIES = [
    (CHAT, b'{"messages": [{"role": "user", "content": 5}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
    (CHAT, b'{"messages": [{"role": "user", "content": [5, null]}]}'),
    (CHAT, b'{"messages": [{"role": null, "content": "x"}]}'),
    (CHAT, b'{"messages": [{"role": [], "content": "x"}]}'),
    (CHAT, b'{"messages": [{"role": {"a": 1}, "content": "x"}]}'),
    (CHAT, b'{"messages": "x"}'),
    (CHAT, b'{"messages": [null]}'),
    (COMPLETIONS, b"[" * DEEP + b"]" * DEEP),
    (COMPLETIONS, b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    (CHAT, b'{"messages": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}"),
    (COMPLETIONS, b'{"prompt": "x", "max_tokens": ' + b"[" * 900 + b"]" * 900 + b"}"),
    (COMPLETIONS, b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}"),  # beyond float
    (COMPLETIONS, b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}"),  # beyond int parsing
    (COMPLETIONS, b'{"prompt": "x", "top_p": NaN}'),
    (COMPLETIONS, b'{"prompt": "x", "temperature": -Infinity}'),
    (COMPLETIONS, b'{"prompt": [[]]}'),
    (COMPLETIONS, b'{"prompt": [1, "a"]}'),
    (COMPLETIONS, b'{"prompt": ["a", 5]}'),
    (COMPLETIONS, b'{"prompt": "x", "cache_salt": 5}'),
    (COMPLETIONS, b'{"prompt": "x", "cache_salt": ""}'),
    (COMPLETIONS, b'{"prompt": "x", "stream_options": []}'),
]


@pytest.mark.parametrize("path, body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_bodies_get_a_4xx_openai_error(url, path, body):
    status, _, answer = exchange(url, post_bytes(path, body))
    assert 400 <= status < 500, answer
    assert is_openai_error(answer), answer
    assert len(answer["error"]["message"]) < 300  # a wrong value is shown briefly, if at all


def test_a_huge_wrong_value_is_not_echoed_back(url):
    body = json.dumps({"prompt": "x", "max_tokens": "9" * 1_000_000}).encode()
    status, _, answer = exchange(url, post_bytes(COMPLETIONS, body))
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    assert len(answer["error"]["message"]) < 200


async def _health_latencies_s(url: str, stop: threading.Event, timeout_s: float) -> list[float]:
    """GET /health every 50 ms until `stop`; each must answer 200 within `timeout_s`."""
    latencies = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            t0 = time.monotonic()
            async with session.get(url + "/health") as response:
                assert response.status == 200
            latencies.append(time.monotonic() - t0)
            await asyncio.sleep(0.05)
    return latencies


def _with_health_polled(url: str, work, *, timeout_s: float = 5.0):
    """Run `work()` while /health is polled, each poll answering within a generous
    `timeout_s`; returns (work's result, health latencies)."""
    stop = threading.Event()
    latencies: list[float] = []
    errors: list[BaseException] = []

    def poll() -> None:
        try:
            latencies.extend(asyncio.run(_health_latencies_s(url, stop, timeout_s)))
        except BaseException as exc:
            errors.append(exc)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.2)
        result = work()
    finally:
        stop.set()
        poller.join(30)
    assert not errors, errors
    assert latencies
    return result, latencies


async def _post(url: str, path: str, data, *, timeout_s: float = 60):
    if isinstance(data, bytes):
        data = io.BytesIO(data)  # aiohttp warns about large raw bytes bodies
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(
            url + path, data=data, headers={"Content-Type": "application/json"}
        ) as response:
            result = response.status, await response.json(content_type=None)
    # A server that answers before the body is all sent closes the connection under the
    # upload; give that transport a turn of the loop to finish closing, or it is collected
    # unclosed during a later test (CI: a ResourceWarning failed the next test).
    await asyncio.sleep(0.1)
    return result


def _post_chunked(url: str, path: str, body: bytes) -> tuple[int, object]:
    """POST `body` in 1 MiB chunks (no Content-Length) on a raw socket; the server may answer
    before the body is all sent."""
    with connect(url) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        try:
            sock.sendall(head.encode())
            for i in range(0, len(body), 1 << 20):
                piece = body[i : i + (1 << 20)]
                sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed early; the answer is still readable
        status, headers, rest = read_head(sock)
        while len(rest) < int(headers["content-length"]):
            rest += sock.recv(65536)
    return status, json.loads(rest)


def test_a_40_mb_body_gets_413_and_health_stays_up(url):
    body = b'{"prompt": "' + b"a" * (40 * 1024 * 1024) + b'"}'

    def work():
        t0 = time.monotonic()
        declared = asyncio.run(_post(url, COMPLETIONS, body))
        streamed = _post_chunked(url, COMPLETIONS, body)  # checked while reading
        return declared, streamed, time.monotonic() - t0

    (declared, streamed, elapsed_s), _ = _with_health_polled(url, work)
    for status, answer in (declared, streamed):
        assert status == 413 and is_openai_error(answer)
        assert "16777216 bytes" in answer["error"]["message"]
        assert "--max-body-bytes" in answer["error"]["message"]
    assert elapsed_s < 30  # generous: each is answered without tokenizing 40 MB (minutes)


def test_a_2_million_character_prompt_gets_400_and_health_stays_up(url):
    body = json.dumps({"prompt": "hello world " * 166_667}).encode()
    (status, answer), _ = _with_health_polled(
        url, lambda: asyncio.run(_post(url, COMPLETIONS, body))
    )
    assert status == 400 and is_openai_error(answer)
    assert answer["error"]["code"] == "context_length_exceeded"
    assert (
        "1000000" in answer["error"]["message"]
        and "--max-prompt-chars" in answer["error"]["message"]
    )


def test_prompts_are_tokenized_off_the_event_loop(url):
    # Four prompts just under the character limit take ~1 s each to tokenize; on the event
    # loop they would hold /health up for ~4 s, past the poller's (still generous) 2 s.
    words = ["hello", "world", "東京", "😀", "capital", "France", "the", "of"]
    text = " ".join(words[i % 7] + words[i % 5] for i in range(110_000))[:900_000]
    body = json.dumps({"prompt": text}).encode()

    async def burst():
        return await asyncio.gather(*(_post(url, COMPLETIONS, body) for _ in range(4)))

    answers, latencies = _with_health_polled(url, lambda: asyncio.run(burst()), timeout_s=2.0)
    for status, answer in answers:  # tokenized, then longer than the 128-token context
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
        assert "tokens" in answer["error"]["message"]
    assert max(latencies) < 2


@pytest.mark.parametrize(
    "stop, ok",
    [
        (["s"] * MAX_STOP_STRINGS, True),
        (["s"] * (MAX_STOP_STRINGS + 1), False),
        (["s" * MAX_STOP_STRING_CHARS], True),
        (["s" * (MAX_STOP_STRING_CHARS + 1)], False),
    ],
    ids=["at-count", "above-count", "at-length", "above-length"],
)
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_stop_string_bounds_are_a_400_naming_the_limit(url, path, stop, ok):
    body = {"max_tokens": 2, "stop": stop}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    status, answer = asyncio.run(_post(url, path, json.dumps(body).encode()))
    if ok:
        assert status == 200, answer
        return
    assert status == 400 and is_openai_error(answer) and answer["error"]["param"] == "stop"
    limit = MAX_STOP_STRINGS if len(stop) > 1 else MAX_STOP_STRING_CHARS
    assert f"at most {limit}" in answer["error"]["message"]


def test_a_half_sent_request_head_is_closed_after_the_header_timeout():
    with _serve(header_timeout_s=0.5) as url, contextlib.ExitStack() as sockets:
        silent = sockets.enter_context(connect(url))
        half = sockets.enter_context(connect(url))
        half.sendall(b"GET /hea")
        dripping = sockets.enter_context(connect(url))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":  # 0.1 s per byte: too slow
                dripping.sendall(bytes([byte]))
                time.sleep(0.1)
        for sock in (silent, half, dripping):
            assert closed_by_peer(sock, timeout_s=10)
        # A keep-alive connection idle between requests is not a slow head: it stays open.
        idle = sockets.enter_context(connect(url))
        for _ in range(2):
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = read_head(idle)
            assert status == 200
            assert len(body) == int(headers["content-length"])
            time.sleep(1.0)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-H%d: v\r\n" % i for i in range(1000))
        + b"\r\n",
        b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"NOT A REQUEST LINE\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    ],
    ids=["100kb-header", "1000-headers", "100kb-path", "bad-request-line", "bad-length"],
)
def test_aiohttp_own_400s_carry_an_openai_error_body(url, request_bytes):
    status, headers, answer = exchange(url, request_bytes)
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert is_openai_error(answer), answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_api_key_guards_v1_routes_only():
    key = "sk-test-key"
    good = {"Authorization": f"Bearer {key}"}
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    with _serve(api_key=key) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            for request in (
                post_bytes(COMPLETIONS, body, headers=headers),
                post_bytes(CHAT, body, headers=headers),
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
                + b"\r\n",
            ):
                status, answer_headers, answer = exchange(url, request)
                assert status == 401 and is_openai_error(answer), answer
                assert answer["error"]["code"] == "invalid_api_key"
                assert answer_headers["www-authenticate"] == "Bearer"
        status, _, answer = exchange(url, post_bytes(COMPLETIONS, body, headers=good))
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
        assert exchange(url, models + b"\r\n\r\n")[0] == 200
        for path in ("/health", "/metrics", "/info"):  # open, as in vLLM
            status, _, _ = exchange(url, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert status == 200, path
