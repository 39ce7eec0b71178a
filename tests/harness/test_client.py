"""The HTTP client: request bodies, options, and the raw timeline `send` records against a live
loopback server. Record-level classification of the mock's faults is `test_error_classes.py`;
this module checks the fields of `RawResult` themselves and the paths that one does not take."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket

import orjson
import pytest
from aiohttp import web
from fake_transport import FakeTransport, stream

from harness.http.client import (
    AiohttpTransport,
    ClientOptions,
    RawResult,
    RequestPayload,
    build_body,
    send,
)
from harness.http.sse import parse_stream
from harness.http.transport import Transport
from harness.run.config import RunConfig
from harness.run.plan import chunk_usage_for as _chunk_usage
from harness.targets.mock_server import MockConfig, start_mock
from slo.runrecord import Endpoint, ErrorClass, RequestStatus

SPEC = {"prompt": "hi", "max_output_tokens": 8}
STREAM_TAIL = b',"stream":true,"stream_options":{"include_usage":true}'


@pytest.mark.parametrize(
    ("endpoint", "stream", "expected"),
    [
        ("completions", True, b'{"model":"m","max_tokens":8,"prompt":"hi"' + STREAM_TAIL + b"}"),
        ("completions", False, b'{"model":"m","max_tokens":8,"prompt":"hi"}'),
        (
            "chat",
            True,
            b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]'
            + STREAM_TAIL
            + b"}",
        ),
        (
            "chat",
            False,
            b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}',
        ),
    ],
)
def test_build_body_per_endpoint(endpoint, stream, expected):
    options = ClientOptions(base_url="http://h/v1", model="m", endpoint=endpoint, stream=stream)
    assert build_body(options, SPEC) == expected


@pytest.mark.parametrize(
    ("chunk_usage", "stream", "options_field"),
    [
        (True, True, {"include_usage": True, "continuous_usage_stats": True}),
        (False, True, {"include_usage": True}),
        (True, False, None),  # not streamed: no stream options at all
    ],
)
def test_build_body_asks_for_the_usage_so_far_in_every_chunk(chunk_usage, stream, options_field):
    options = ClientOptions(
        base_url="http://h/v1", model="m", stream=stream, chunk_usage=chunk_usage
    )
    assert json.loads(build_body(options, SPEC)).get("stream_options") == options_field


@pytest.mark.parametrize(
    ("flag", "engine", "expected"),
    [
        (None, "engine_ref", True),
        (None, "vllm", True),
        (None, "llamacpp", False),  # may reject a stream option it does not know
        (None, None, False),  # a URL target that says nothing about itself
        (True, None, True),
        (False, "vllm", False),
    ],
)
def test_chunk_usage_is_on_by_default_only_for_engines_that_honour_it(flag, engine, expected):
    assert _chunk_usage(RunConfig(chunk_usage=flag), engine) is expected


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"ignore_eos": True, "temperature": 0.0, "top_p": None, "seed": 7},
            b'{"model":"m","max_tokens":8,"prompt":"hi","ignore_eos":true,"temperature":0.0,"seed":7}',
        ),
        (
            {"ignore_eos": False, "top_p": 0.5, "max_output_tokens": 8.0},
            b'{"model":"m","max_tokens":8,"prompt":"hi","top_p":0.5}',
        ),
    ],
)
def test_build_body_sampling_fields(extra, expected):
    options = ClientOptions(base_url="http://h/v1", model="m", stream=False)
    assert build_body(options, {**SPEC, **extra}) == expected


@pytest.mark.parametrize(
    ("base_url", "endpoint", "url", "is_chat"),
    [
        ("http://h:8000/v1", "completions", "http://h:8000/v1/completions", False),
        ("http://h:8000/v1/", Endpoint.COMPLETIONS, "http://h:8000/v1/completions", False),
        ("http://h:8000/v1", "chat", "http://h:8000/v1/chat/completions", True),
        ("http://h:8000/v1/", Endpoint.CHAT, "http://h:8000/v1/chat/completions", True),
    ],
)
def test_options_url_per_endpoint(base_url, endpoint, url, is_chat):
    options = ClientOptions(base_url=base_url, model="m", endpoint=endpoint)
    assert options.url == url
    assert options.is_chat is is_chat
    assert isinstance(options.endpoint, Endpoint)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout_s": 0}, "timeout_s must be positive"),
        ({"timeout_s": -1.0}, "timeout_s must be positive"),
        ({"endpoint": "moderations"}, "moderations"),
    ],
)
def test_options_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClientOptions(base_url="http://h/v1", model="m", **kwargs)


def test_options_are_frozen():
    options = ClientOptions(base_url="http://h/v1", model="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.model = "other"  # type: ignore[misc]


def test_transports_satisfy_the_protocol():
    options = ClientOptions(base_url="http://h/v1", model="m")
    assert isinstance(AiohttpTransport(options, max_connections=1), Transport)
    assert isinstance(FakeTransport(stream(["a"])), Transport)


def test_transport_owns_its_session():
    async def go():
        transport = AiohttpTransport(ClientOptions("http://h/v1", "m"), max_connections=1)
        assert transport.session is None
        async with transport as entered:
            session = entered.session
            assert entered is transport and not session.closed
        assert transport.session is None and session.closed

    asyncio.run(go())


@contextlib.asynccontextmanager
async def _mock(config: MockConfig):
    runner, base_url = await start_mock(config)
    try:
        yield base_url
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _app(routes: list[web.RouteDef]):
    """A throwaway aiohttp server on a free loopback port; yields its base URL (…/v1)."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


async def _send_one(options: ClientOptions, body: bytes | None = None) -> RawResult:
    payload = RequestPayload("r", build_body(options, SPEC) if body is None else body)
    result = RawResult("r", False, 0)
    async with AiohttpTransport(options, max_connections=1) as transport:
        await send(transport.session, options, payload, result)
    return result


def _assert_ordered(raw: RawResult) -> None:
    times = [raw.t_sent_ns, raw.t_first_byte_ns, *(t for t, _ in raw.reads), raw.t_done_ns]
    assert None not in times and times == sorted(times)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_send_streamed_success_records_every_read(endpoint):
    async def go():
        async with _mock(MockConfig(ttft_ms=2, itl_ms=2)) as url:
            return await _send_one(ClientOptions(url, "mock", endpoint=endpoint, timeout_s=10))

    raw = asyncio.run(go())
    assert (raw.http_status, raw.status, raw.error_class, raw.body) == (200, None, None, None)
    assert raw.reads
    _assert_ordered(raw)
    assert b"".join(data for _, data in raw.reads).endswith(b"data: [DONE]\n\n")
    parsed = parse_stream(raw.reads, chat=endpoint == "chat")
    assert parsed.error_class is None
    assert parsed.text == "".join(f" t{i}" for i in range(8))
    assert parsed.usage["completion_tokens"] == 8


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_send_non_streamed_success_keeps_the_body(endpoint):
    async def go():
        async with _mock(MockConfig(ttft_ms=2, itl_ms=2)) as url:
            options = ClientOptions(url, "mock", endpoint=endpoint, stream=False, timeout_s=10)
            return await _send_one(options)

    raw = asyncio.run(go())
    assert (raw.http_status, raw.status, raw.error_class, raw.reads) == (200, None, None, [])
    assert raw.t_sent_ns <= raw.t_first_byte_ns <= raw.t_done_ns
    choice = orjson.loads(raw.body)["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    assert text == "".join(f" t{i}" for i in range(8))


@pytest.mark.parametrize(
    ("config", "body", "http_status", "status", "error_class", "message"),
    [
        (
            MockConfig(error_rate=1.0),
            None,
            500,
            RequestStatus.ERROR,
            ErrorClass.HTTP_5XX,
            "the mock failed this request on purpose",
        ),
        (
            MockConfig(reject_rate=1.0),
            None,
            429,
            RequestStatus.REJECTED,
            ErrorClass.REJECTED_429,
            "the mock's queue is full",
        ),
        (
            MockConfig(),
            b"{not json",
            400,
            RequestStatus.ERROR,
            ErrorClass.HTTP_4XX,
            "the request body is not JSON",
        ),
    ],
    ids=["500", "429", "400"],
)
def test_send_http_error_takes_the_message_from_the_openai_body(
    config, body, http_status, status, error_class, message
):
    async def go():
        async with _mock(config) as url:
            return await _send_one(ClientOptions(url, "mock", timeout_s=10), body)

    raw = asyncio.run(go())
    assert (raw.http_status, raw.status, raw.error_class) == (http_status, status, error_class)
    assert raw.error_message == message
    assert orjson.loads(raw.body)["error"]["message"] == message
    assert raw.reads == []
    assert raw.t_sent_ns <= raw.t_first_byte_ns <= raw.t_done_ns


@pytest.mark.parametrize(
    ("http_status", "body", "error_class", "message"),
    [
        (503, b"upstream down", ErrorClass.HTTP_5XX, "upstream down"),
        (400, b'{"error": "plain words"}', ErrorClass.HTTP_4XX, "plain words"),
        (418, b'{"error": {"message": "teapot"}}', ErrorClass.HTTP_4XX, "teapot"),
        (500, orjson.dumps({"error": {"message": "x" * 1000}}), ErrorClass.HTTP_5XX, "x" * 300),
    ],
)
def test_send_error_message_from_other_bodies(http_status, body, error_class, message):
    async def handler(_request: web.Request) -> web.Response:
        return web.Response(status=http_status, body=body)

    async def go():
        async with _app([web.post("/v1/completions", handler)]) as url:
            return await _send_one(ClientOptions(url, "m", timeout_s=10))

    raw = asyncio.run(go())
    assert (raw.http_status, raw.error_class, raw.error_message) == (
        http_status,
        error_class,
        message,
    )


@pytest.mark.parametrize(
    ("api_key", "authorization"), [("sk-test", "Bearer sk-test"), (None, None)]
)
@pytest.mark.parametrize(
    ("endpoint", "path"), [("completions", "/v1/completions"), ("chat", "/v1/chat/completions")]
)
def test_request_reaches_the_server_as_built(api_key, authorization, endpoint, path):
    seen: list[tuple[str, dict, bytes]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.path, dict(request.headers), await request.read()))
        return web.json_response({"choices": [{"index": 0, "text": "ok"}]})

    options = ClientOptions("", "m", endpoint=endpoint, stream=False, api_key=api_key)

    async def go():
        async with _app([web.post(path, handler)]) as url:
            return await _send_one(dataclasses.replace(options, base_url=url))

    raw = asyncio.run(go())
    assert raw.http_status == 200 and raw.status is None
    [(seen_path, headers, body)] = seen
    assert seen_path == path
    assert body == build_body(options, SPEC)
    assert headers.get("Authorization") == authorization
    assert headers["Content-Type"] == "application/json"
    assert "User-Agent" not in headers


def test_connection_pool_is_capped_at_max_connections():
    active = {"now": 0, "peak": 0}

    async def handler(_request: web.Request) -> web.Response:
        active["now"] += 1
        active["peak"] = max(active["peak"], active["now"])
        await asyncio.sleep(0.02)
        active["now"] -= 1
        return web.json_response({"choices": [{"index": 0, "text": "ok"}]})

    async def go():
        async with _app([web.post("/v1/completions", handler)]) as url:
            options = ClientOptions(url, "m", stream=False, timeout_s=10)
            results = [RawResult(f"r{i}", False, 0) for i in range(5)]
            async with AiohttpTransport(options, max_connections=2) as transport:
                await asyncio.gather(
                    *(
                        transport.handle_request(RequestPayload(r.request_id, b"{}"), r)
                        for r in results
                    )
                )
            return results

    results = asyncio.run(go())
    assert [r.http_status for r in results] == [200] * 5
    assert 1 <= active["peak"] <= 2


def test_timeout_before_the_first_byte():
    async def go():
        async with _mock(MockConfig(ttft_ms=400)) as url:
            return await _send_one(ClientOptions(url, "mock", stream=False, timeout_s=0.1))

    raw = asyncio.run(go())
    assert (raw.status, raw.error_class) == (RequestStatus.TIMEOUT, ErrorClass.TIMEOUT)
    assert raw.error_message == "no complete response within 0.1 s"
    assert (raw.http_status, raw.t_first_byte_ns, raw.body, raw.reads) == (None, None, None, [])
    assert raw.t_sent_ns <= raw.t_done_ns


def test_timeout_mid_stream_keeps_what_arrived():
    config = MockConfig(ttft_ms=1, itl_ms=1, stall_rate=1.0, stall_s=0.5)

    async def go():
        async with _mock(config) as url:
            return await _send_one(ClientOptions(url, "mock", timeout_s=0.2))

    raw = asyncio.run(go())
    assert (raw.status, raw.error_class) == (RequestStatus.TIMEOUT, ErrorClass.TIMEOUT)
    assert raw.http_status == 200 and raw.reads
    _assert_ordered(raw)
    assert b"[DONE]" not in b"".join(data for _, data in raw.reads)


def test_connection_refused_has_no_response_fields():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket is closed
    options = ClientOptions(f"http://127.0.0.1:{port}/v1", "m", timeout_s=10)
    raw = asyncio.run(_send_one(options))
    assert (raw.status, raw.error_class) == (RequestStatus.ERROR, ErrorClass.CONNECTION_REFUSED)
    assert raw.error_message.startswith("ClientConnectorError")
    assert "\n" not in raw.error_message
    assert (raw.http_status, raw.t_first_byte_ns, raw.reads) == (None, None, [])
    assert raw.t_sent_ns <= raw.t_done_ns


def test_server_closing_before_responding_is_a_reset():
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.close()

    async def go():
        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await _send_one(ClientOptions(f"http://127.0.0.1:{port}/v1", "m"))
        finally:
            server.close()
            await server.wait_closed()

    raw = asyncio.run(go())
    assert (raw.status, raw.error_class) == (RequestStatus.UNKNOWN, ErrorClass.CONNECTION_RESET)
    assert raw.http_status is None and raw.t_sent_ns <= raw.t_done_ns


def test_cancelled_send_says_cancelled_and_reraises():
    async def go():
        async with _mock(MockConfig(ttft_ms=300)) as url:
            options = ClientOptions(url, "mock", stream=False, timeout_s=10)
            raw = RawResult("r", False, 0)
            payload = RequestPayload("r", build_body(options, SPEC))
            async with AiohttpTransport(options, max_connections=1) as transport:
                task = asyncio.create_task(transport.handle_request(payload, raw))
                async with asyncio.timeout(5):
                    while raw.t_sent_ns is None:
                        await asyncio.sleep(0.001)
                await asyncio.sleep(0.02)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            return raw

    raw = asyncio.run(go())
    assert (raw.status, raw.error_class) == (RequestStatus.CANCELLED, None)
    assert raw.error_message
    assert raw.t_first_byte_ns is None and raw.t_sent_ns <= raw.t_done_ns
