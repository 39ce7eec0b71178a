"""`bench serve --replicas 2` as a user starts it, and a worker killed under load: the requests
in flight on it end with an explicit error, those on the other worker finish, new requests go
to the survivor, /health says degraded, and no worker outlives the router, even one killed
with SIGKILL. Also the CLI's own refusals, in one sentence."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from cluster_util import is_running, post_json, request

from engine_ref.cluster.replicas import worker_cpus
from engine_ref.cluster.routing import POLICIES
from engine_ref.serving.cli_serve import serve


def _children(pid: int) -> list[int]:
    """The worker processes `pid` started (its spawned children), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def _post(url: str, body: dict) -> urllib.request.Request:
    data = json.dumps(body).encode()
    return urllib.request.Request(f"{url}/v1/completions", data=data, method="POST")


def _inflight(url: str) -> float:
    text = request(url, "/metrics")[2].decode()
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("router_inflight{")
    )


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.slow  # starts the router and two workers
def test_a_killed_worker_fails_its_requests_explicitly_and_the_other_serves(tmp_path):
    port_file = tmp_path / "port"
    command = [
        sys.executable, "-m", "engine_ref.serving", "--model", "tiny-random", "--dtype",
        "float32", "--num-blocks", "128", "--port", "0", "--port-file", str(port_file),
        "--replicas", "2", "--router", "round-robin", "--enable-fault-injection",
        "--log-level", "warning",
    ]  # fmt: skip
    with open(tmp_path / "router.log", "wb") as log:
        router = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    workers: list[int] = []
    try:
        assert _wait(lambda: port_file.exists() and port_file.read_text().strip(), 120)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        workers = _children(router.pid)
        assert len(workers) == 2
        shares = [os.sched_getaffinity(pid) for pid in workers]
        if len(os.sched_getaffinity(0)) >= 2:  # each worker on its own CPUs
            assert not shares[0] & shares[1], shares
        assert post_json(url, "/admin/step_delay", {"delay_ms": 40}) == (200, {"delay_ms": 40})

        body = {"model": "tiny-random", "prompt": "a b", "max_tokens": 40, "ignore_eos": True}
        answers: dict[str, tuple] = {}
        first_chunk = {"s0": threading.Event(), "s1": threading.Event()}

        def send(name: str, stream: bool) -> None:
            if not stream:
                status, _, raw = request(url, "/v1/completions", body)
                answers[name] = (status, raw.decode())
                return
            lines = []
            with urllib.request.urlopen(_post(url, {**body, "stream": True}), timeout=60) as up:
                for line in up:
                    lines.append(line.decode())
                    first_chunk[name].set()
            answers[name] = (up.status, "".join(lines))

        threads = []
        for sent, (name, stream) in enumerate(
            [("s0", True), ("s1", True), ("n0", False), ("n1", False)], start=1
        ):
            threads.append(threading.Thread(target=send, args=(name, stream)))
            threads[-1].start()
            assert _wait(lambda n=sent: _inflight(url) == n, 30)  # round robin: 0, 1, 0, 1
        assert all(event.wait(30) for event in first_chunk.values())  # both streams under way
        os.kill(workers[0], signal.SIGKILL)
        for thread in threads:
            thread.join(60)

        said = re.compile(
            r"Worker ([01]) \(http://127\.0\.0\.1:\d+\) was killed by SIGKILL while serving "
            r"this request\."
        )
        stream_errors = [said.search(answers[s][1]) for s in ("s0", "s1")]
        assert sorted(m is None for m in stream_errors) == [False, True], answers
        (lost,) = [m.group(1) for m in stream_errors if m is not None]
        kept = str(1 - int(lost))
        assert answers[f"s{lost}"][0] == 200 and "[DONE]" not in answers[f"s{lost}"][1]
        assert answers[f"s{kept}"][1].rstrip().endswith("data: [DONE]")
        status, text = answers[f"n{lost}"]
        assert status == 502 and said.search(json.loads(text)["error"]["message"]).group(1) == lost
        assert answers[f"n{kept}"][0] == 200

        status, health = post_json(url, "/health", None)
        assert status == 200 and health["status"] == "degraded"
        assert [(w["up"], w["exit"]) for w in health["workers"]][int(lost)] == (
            False,
            "was killed by SIGKILL",
        )
        assert post_json(url, "/admin/step_delay", {"delay_ms": 0})[0] == 200
        for _ in range(3):  # round robin goes on over the survivor alone
            assert post_json(url, "/v1/completions", {**body, "max_tokens": 2})[0] == 200
        text = request(url, "/metrics")[2].decode()
        assert f'router_worker_up{{worker="{lost}"}} 0.0' in text
        assert f'router_requests_total{{policy="round-robin",worker="{kept}"}} 5.0' in text

        # The router dies without stopping its workers: the survivor stops on its own.
        router.kill()
        router.wait(10)
        assert _wait(lambda: not any(is_running(pid) for pid in workers), 15)
    finally:
        if router.poll() is None:
            router.kill()
            router.wait(10)
        for pid in workers:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--router", "least-loaded"], "--router needs --replicas 2 or more."),
        (["--replicas", "2", "--router", "random"],
         "Unknown --router 'random'; known: round-robin, least-loaded, prefix-affinity."),
        (["--replicas", "0"], "0 is not in the range x>=1"),
    ],
)  # fmt: skip
def test_the_cli_refuses_bad_cluster_options_in_one_sentence(args, says):
    result = CliRunner().invoke(serve, ["--model", "tiny-random", *args])
    assert result.exit_code == 2 and says in result.output, result.output


@pytest.mark.parametrize(
    ("n_cpus", "replicas", "expected"),
    [
        (2, 2, [{0}, {1}]),
        (8, 3, [{0, 1, 2}, {3, 4, 5}, {6, 7}]),
        (4, 4, [{0}, {1}, {2}, {3}]),
        (2, 3, [{0}, {1}, {0}]),  # more workers than CPUs: shared round robin
        (1, 2, [{0}, {0}]),
    ],
)
def test_workers_get_their_own_share_of_the_cpus(monkeypatch, n_cpus, replicas, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n_cpus)))
    assert [worker_cpus(i, replicas) for i in range(replicas)] == expected


def test_the_help_names_every_policy():
    result = CliRunner().invoke(serve, ["--help"], terminal_width=200)
    text = " ".join(result.output.split())
    assert all(name in text for name in POLICIES)
