"""A pause of the managed reference engine stops every process of it. With `--engine-loop
process` the engine steps in a child of the HTTP process; a SIGSTOP to the parent alone froze
the streams while the child kept running. `ManagedServer.pause` (what a `pause_engine` fault
window calls) now stops the whole process group: every process is in state T and uses no CPU
while paused, and both run again after `resume`."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from harness.targets.managed import ManagedServerConfig, managed_server

pytestmark = pytest.mark.slow  # starts a server process


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, CPU ticks used) of `pid` from /proc, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], int(fields[11]) + int(fields[12])


def _tree(root: int) -> dict[int, tuple[str, int]]:
    """{pid: (state, CPU ticks)} of `root` and every process descended from it."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = stat
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in stats:
            tree[pid] = stats[pid][1:]
            frontier += [child for child, (ppid, _, _) in stats.items() if ppid == pid]
    return tree


def _stream(base_url: str, started: threading.Event) -> None:
    body = {"model": "tiny-random", "prompt": "one two three", "max_tokens": 6000,
            "ignore_eos": True, "stream": True, "temperature": 0}  # fmt: skip
    request = urllib.request.Request(
        f"{base_url}/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    started.set()
    except OSError:
        pass  # the server is stopped under it at the end of the test


def test_a_pause_stops_every_process_of_a_process_mode_server(tmp_path):
    config = ManagedServerConfig(
        model="tiny-random", startup_timeout_s=120, extra_args=("--engine-loop", "process")
    )
    with managed_server(config, log_dir=tmp_path) as server:
        started = threading.Event()
        threading.Thread(target=_stream, args=(server.base_url, started), daemon=True).start()
        assert started.wait(60), "no token streamed"
        assert len(_tree(server.pid)) >= 2, "no engine child: is --engine-loop process on?"
        server.pause()
        time.sleep(0.3)  # SIGSTOP lands asynchronously
        paused = _tree(server.pid)
        time.sleep(1.0)
        still = _tree(server.pid)
        assert {pid: state for pid, (state, _) in paused.items()} == dict.fromkeys(paused, "T")
        assert still == paused  # no process used a CPU tick while paused: the engine stood still
        server.resume()
        time.sleep(1.0)
        running = _tree(server.pid)
    assert all(state != "T" for state, _ in running.values()), running
    assert sum(ticks for _, ticks in running.values()) > sum(
        ticks for _, ticks in paused.values()
    ), "nothing ran again after resume"
