"""Test support for the cluster: the router (with its worker processes) on a background thread
of the test process, and small loopback HTTP helpers (urllib only)."""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from server_fixtures import running_in_thread

from engine_ref.cluster.router import serve_cluster
from engine_ref.serving.server import ServerConfig


def worker_processes() -> list[multiprocessing.Process]:
    """The cluster's worker processes started by this process (by their names)."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("engine-worker-")]


@contextlib.contextmanager
def running_cluster(
    config: ServerConfig, *, replicas: int, policy: str, startup_timeout_s: float = 120.0
) -> Iterator[str]:
    """`serve_cluster` on a background thread with its own event loop; yields the router's
    base URL and, on exit, stops it and checks that no worker process is left."""
    serving = functools.partial(serve_cluster, config, replicas=replicas, policy=policy)
    with running_router(serving, startup_timeout_s) as url:
        yield url


@contextlib.contextmanager
def running_router(serving, startup_timeout_s: float) -> Iterator[str]:
    """A router coroutine (`serve_cluster`, `serve_pd_cluster` partially applied) on a
    background thread; on exit, no worker process it started may outlive it."""
    with running_in_thread(serving, name="router", startup_timeout_s=startup_timeout_s) as url:
        pids = [p.pid for p in worker_processes()]
        yield url
    left = [pid for pid in pids if is_running(pid)]
    assert not left, f"worker processes {left} outlived the router"


def is_running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def request(
    url: str, path: str, body: bytes | dict | None = None, *, timeout_s: float = 60.0
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers lower-cased, body) of a GET (no body) or POST."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(
        f"{url}{path}", data=data, method="GET" if data is None else "POST"
    )
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as answer:
            status, headers, raw = answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        status, headers, raw = error.code, dict(error.headers), error.read()
    return status, {k.lower(): v for k, v in headers.items()}, raw


def post_json(url: str, path: str, body: dict | None, **kw) -> tuple[int, dict]:
    """(status, JSON answer) of a POST of `body`, or of a GET when `body` is None."""
    status, _, raw = request(url, path, body, **kw)
    return status, json.loads(raw)


def sse_events(url: str, path: str, body: dict, *, timeout_s: float = 60.0) -> list[dict | str]:
    """The `data:` payloads of a streamed answer, JSON-decoded ("[DONE]" kept as a string)."""
    return [json.loads(d) if d != "[DONE]" else d for d in sse_data(url, path, body, timeout_s)]


def sse_data(url: str, path: str, body: dict, timeout_s: float = 60.0) -> list[str]:
    _, _, raw = request(url, path, {**body, "stream": True}, timeout_s=timeout_s)
    lines = raw.decode().splitlines()
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def bench_run_mixed_checked(url: str, out: Path) -> dict:
    """`bench run --workload mixed --check-outputs` (4 requests, all at once) against `url`;
    asserts it exited 0 with the 4 outputs compared and none wrong; returns summary.json."""
    from click.testing import CliRunner

    from harness.cli import bench

    result = CliRunner().invoke(
        bench,
        ["run", "--url", url, "--model", "tiny-random", "--workload", "mixed",
         "--num-requests", "4", "--request-rate", "inf", "--check-outputs", "--out", str(out),
         "--quiet"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["correctness"]["n_compared"], summary["correctness"]["n_wrong"]) == (4, 0)
    return summary
