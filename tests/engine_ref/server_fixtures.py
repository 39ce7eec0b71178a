"""Test support: the reference server on a background thread of the test process, and small
loopback HTTP helpers for what an HTTP client library would not send (raw bytes, half
requests, clients that stop reading)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from engine_ref.serving.engine_loop import EngineLoop
from engine_ref.serving.server import ServerConfig, ServerError, serve


@contextlib.contextmanager
def running_in_thread(
    serving: Callable[..., Awaitable[None]], *, name: str, startup_timeout_s: float = 120.0
) -> Iterator[str]:
    """Run `serving(on_listening=..., stop=...)` (a server, router or cluster coroutine) on a
    background thread with its own event loop; yields the base URL it reports once bound and
    stops it on exit."""
    started = threading.Event()
    urls: list[str] = []
    errors: list[BaseException] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def on_listening(url: str) -> None:
        urls.append(url)
        started.set()

    def run() -> None:
        try:
            loop.run_until_complete(serving(on_listening=on_listening, stop=stop))
        except BaseException as exc:
            errors.append(exc)
        finally:
            started.set()
            loop.close()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        if not started.wait(startup_timeout_s):
            raise ServerError(f"The server did not start within {startup_timeout_s:.0f} s.")
        if errors:
            raise errors[0]
        yield urls[0]
    finally:
        if thread.is_alive():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
            thread.join(60.0)


@contextlib.contextmanager
def running_server(
    config: ServerConfig, *, engine_loop: EngineLoop | None = None, startup_timeout_s: float = 120.0
) -> Iterator[str]:
    """Run the server on a background thread with its own event loop; yields the base URL
    (use port 0 for a free port) and stops the server, engine included, on exit."""
    serving = functools.partial(serve, config, engine_loop=engine_loop)
    with running_in_thread(
        serving, name="engine-ref-server", startup_timeout_s=startup_timeout_s
    ) as url:
        yield url


def connect(url: str, *, timeout_s: float = 30.0, rcvbuf_bytes: int | None = None) -> socket.socket:
    """A loopback TCP connection to the server at `url`; `rcvbuf_bytes` shrinks its receive
    buffer (set before connecting, so the TCP window starts small)."""
    address = urllib.parse.urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
    sock.settimeout(timeout_s)
    sock.connect((address.hostname, address.port))
    return sock


def post_bytes(path: str, body: bytes, *, headers: dict[str, str] | None = None) -> bytes:
    """An HTTP/1.1 POST of `body` as raw bytes."""
    lines = [f"POST {path} HTTP/1.1", "Host: localhost", "Content-Type: application/json"]
    lines += [f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one response head: (status, headers lower-cased, bytes read past the head)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed after {data!r}")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split()[1])
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, rest


def exchange(url: str, request: bytes, *, timeout_s: float = 30.0) -> tuple[int, dict, object]:
    """Send raw request bytes on a new connection and read one answer with a Content-Length:
    (status, headers, JSON body or text)."""
    with connect(url, timeout_s=timeout_s) as sock:
        sock.sendall(request)
        status, headers, body = read_head(sock)
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    text = body.decode("utf-8", "replace")
    if headers.get("content-type", "").startswith("application/json"):
        return status, headers, json.loads(text)
    return status, headers, text


def closed_by_peer(sock: socket.socket, *, timeout_s: float) -> bool:
    """Whether the server closes `sock` within `timeout_s` (reading and dropping whatever it
    still sends)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def is_openai_error(body: object) -> bool:
    """Whether `body` is `{"error": {"message", "type", "param", "code"}}` with a message."""
    return (
        isinstance(body, dict)
        and set(body) == {"error"}
        and isinstance(body["error"], dict)
        and set(body["error"]) == {"message", "type", "param", "code"}
        and isinstance(body["error"]["message"], str)
        and bool(body["error"]["message"])
    )


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text; labels given must all match."""
    for line in text.splitlines():
        match = re.fullmatch(r"([^\s{]+)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    raise AssertionError(f"metric {name} {labels} not found")


def scrape(url: str, *, timeout_s: float = 30.0) -> str:
    status, _, text = exchange(
        url, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", timeout_s=timeout_s
    )
    assert status == 200
    return text


def idle_gauges(text: str) -> tuple[float, float, float]:
    """(running, waiting, KV blocks used) from /metrics text."""
    return (
        metric(text, "vllm:num_requests_running"),
        metric(text, "vllm:num_requests_waiting"),
        metric(text, "vllm:kv_cache_blocks_used"),
    )


def wait_until(
    condition: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.05
) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)


@contextlib.contextmanager
def server_process(
    workdir: Path, *args: str, startup_timeout_s: float = 120.0
) -> Iterator[tuple[str, int]]:
    """`python -m engine_ref.serving --model tiny-random --port 0 --port-file F ARGS` as a
    subprocess (as `harness/managed.py` launches it); yields (base URL, pid) once /health
    answers, and stops it (SIGTERM, then SIGKILL after 30 s) on exit."""
    port_file = workdir / "port"
    log_path = workdir / "server.log"
    command = [
        sys.executable, "-m", "engine_ref.serving", "--model", "tiny-random",
        "--port", "0", "--port-file", str(port_file), "--log-level", "warning", *args,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_timeout_s
        url = None
        while url is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise ServerError(f"The server did not start: {log_path.read_text()[-2000:]}")
            text = port_file.read_text().strip() if port_file.exists() else ""
            if text:
                candidate = f"http://127.0.0.1:{int(text)}"
                with contextlib.suppress(OSError):
                    if exchange(candidate, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200:
                        url = candidate
            time.sleep(0.1)
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def rss_kib(pid: int) -> int:
    """Resident set size of process `pid` (VmRSS of /proc/<pid>/status), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")
