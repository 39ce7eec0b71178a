"""`bench mock-server` over HTTP: the bounds it holds requests to, and that it stops
generating for a client that left."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from harness.targets.mock_server import MAX_TOKENS_LIMIT

pytestmark = pytest.mark.slow  # each test starts a server


def _post(url: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url + "/completions", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/stats", timeout=5) as response:
        return json.loads(response.read())


def _completion(**fields) -> dict:
    return {"model": "mock", "prompt": "Hello", **fields}


def test_max_tokens_bound_is_a_documented_mebi_token():
    assert MAX_TOKENS_LIMIT == 1_048_576


@pytest.mark.parametrize(
    ("max_tokens", "status", "message"),
    [
        (-1, 400, "max_tokens must be at least 1, got -1."),
        (0, 400, "max_tokens must be at least 1, got 0."),
        (1, 200, None),
        (MAX_TOKENS_LIMIT + 1, 400, f"max_tokens must be at most {MAX_TOKENS_LIMIT}, got "
                                    f"{MAX_TOKENS_LIMIT + 1}."),
        (2**63, 400, f"max_tokens must be at most {MAX_TOKENS_LIMIT}, got {2**63}."),
        ("8", 400, "max_tokens must be an integer, got '8'."),
        (True, 400, "max_tokens must be an integer, got True."),
        (8.0, 400, "max_tokens must be an integer, got 8.0."),
        (None, 200, None),  # null: the default, as when absent
    ],
)  # fmt: skip
def test_max_tokens_outside_its_bounds_is_a_400(mock_server, max_tokens, status, message):
    with mock_server("--ttft-ms", "0", "--itl-ms", "0") as url:
        code, body = _post(url, _completion(max_tokens=max_tokens))
        assert code == status, body
        if message is None:
            assert body["choices"][0]["text"]
        else:
            assert body == {"error": {"message": message, "type": "invalid_request_error",
                                      "param": "max_tokens", "code": 400}}  # fmt: skip
        assert _post(url, _completion(max_tokens=2))[0] == 200  # still serving


def test_max_tokens_at_the_bound_is_served(mock_server):
    """The bound itself is allowed: a stream of MAX_TOKENS_LIMIT tokens starts (the client
    leaves after the first event), and the non-stream default is 16 tokens."""
    with mock_server("--ttft-ms", "0", "--itl-ms", "0") as url:
        with _open_stream(url, MAX_TOKENS_LIMIT) as sock:
            assert b"200 OK" in _read_until(sock, b"data: ")
        code, body = _post(url, _completion())
        assert code == 200 and body["usage"]["completion_tokens"] == 16


def test_max_completion_tokens_has_the_same_bounds(mock_server):
    with mock_server("--ttft-ms", "0", "--itl-ms", "0") as url:
        code, body = _post(url, _completion(max_completion_tokens=0))
        assert code == 400 and body["error"]["param"] == "max_completion_tokens"
        code, body = _post(url, _completion(max_completion_tokens=3))
        assert code == 200 and body["usage"]["completion_tokens"] == 3


def test_a_body_that_is_not_an_object_is_a_400(mock_server):
    with mock_server() as url:
        code, body = _post(url, b"[1, 2]")
        assert code == 400 and body["error"]["type"] == "invalid_request_error"


def _open_stream(url: str, max_tokens: int) -> socket.socket:
    host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps(_completion(max_tokens=max_tokens, stream=True)).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    seen = b""
    while marker not in seen:
        data = sock.recv(65536)
        assert data, "the server closed the stream"
        seen += data
    return seen


def _tokens_when_still(url: str, *, still_s: float = 0.3, within_s: float = 10.0) -> int:
    """The server's generated-token count once it stops changing for `still_s`."""
    deadline = time.monotonic() + within_s
    last = _stats(url)["tokens_generated"]
    while time.monotonic() < deadline:
        time.sleep(still_s)
        now = _stats(url)["tokens_generated"]
        if now == last:
            return now
        last = now
    raise AssertionError(f"the server still generates {within_s} s after the client left")


@pytest.mark.parametrize("itl_ms", ["0", "2"])
def test_a_stream_stops_generating_when_its_client_leaves(mock_server, itl_ms):
    with mock_server("--ttft-ms", "0", "--itl-ms", itl_ms) as url:
        with _open_stream(url, MAX_TOKENS_LIMIT) as sock:
            _read_until(sock, b"data: ")
            time.sleep(0.2)
            assert _stats(url)["tokens_generated"] > 0
        stopped_at = _tokens_when_still(url)
        time.sleep(0.5)
        assert _stats(url)["tokens_generated"] == stopped_at
        assert stopped_at < MAX_TOKENS_LIMIT
        assert _stats(url)["streams_abandoned"] == 1


def _wait_for(url: str, done, within_s: float = 5.0) -> dict:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        stats = _stats(url)
        if done(stats):
            return stats
        time.sleep(0.05)
    raise AssertionError(f"not within {within_s} s: {stats}")


def test_a_client_that_leaves_between_tokens_is_dropped_at_once(mock_server):
    """The next token is a minute away: the server must not hold the request, nor send that
    token, for a client that has gone."""
    with mock_server("--ttft-ms", "0", "--itl-ms", "60000") as url:
        with _open_stream(url, 5) as sock:
            _read_until(sock, b"data: ")
            assert _wait_for(url, lambda s: s["tokens_generated"] == 1)["running"] == 1
        stats = _wait_for(url, lambda s: s["running"] == 0)
        assert stats["streams_abandoned"] == 1 and stats["tokens_generated"] == 1
