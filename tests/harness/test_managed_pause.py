"""A pause of the managed reference engine stops every process of it. With `--engine-loop
process` the engine steps in a child of the HTTP process; a SIGSTOP to the parent alone froze
the streams while the child kept running. `ManagedServer.pause` (what a `pause_engine` fault
window calls) now stops the whole process group: every process is in state T and uses no CPU
(so the engine takes no step) while paused, and both run again after `resume`. Checked on the
server object and through `bench run --faults pause-engine`, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
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


TRACKER = b"multiprocessing.resource_tracker"  # the engine child's helper: it sleeps


def _server_tree(bench_pid: int, trackers: set[int]) -> dict[int, tuple[str, int]]:
    """The managed reference server's processes under a `bench run` process: its descendants
    whose command line runs `engine_ref.serving` (the HTTP process) or Python's multiprocessing
    (the engine child and its resource tracker, whose pid goes into `trackers`)."""
    tree = _tree(bench_pid)
    tree.pop(bench_pid, None)
    serving = {}
    for pid, stat in tree.items():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"engine_ref.serving" in cmdline or b"multiprocessing" in cmdline:
            serving[pid] = stat
        if TRACKER in cmdline:
            trackers.add(pid)
    return serving


def test_a_pause_engine_window_of_bench_run_stops_the_whole_process_mode_server(tmp_path):
    """The built-in `pause-engine` plan stops the managed server from 5 s to 8 s: sampled every
    50 ms from /proc, every process of it (HTTP and engine child) is in state T for about the
    window and uses no CPU tick meanwhile; afterwards all run again and the run loses nothing."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "harness.cli", "run", "--model", "tiny-random",
           "--faults", "pause-engine", "--request-rate", "4", "--num-requests", "48",
           "--server-arg=--engine-loop", "--server-arg=process", "--out", str(out), "--quiet"]  # fmt: skip
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples: list[tuple[float, dict[int, tuple[str, int]]]] = []
    trackers: set[int] = set()
    deadline = time.monotonic() + 240
    while bench.poll() is None and time.monotonic() < deadline:
        if tree := _server_tree(bench.pid, trackers):
            samples.append((time.monotonic(), tree))
        time.sleep(0.05)
    console = bench.communicate(timeout=60)[0]
    assert bench.returncode == 0, console[-3000:]
    assert max(len(tree) for _, tree in samples) >= 2, "no engine child: is --engine-loop on?"
    frozen = [
        (t, tree) for t, tree in samples
        if len(tree) >= 2 and all(state == "T" for state, _ in tree.values())
    ]  # fmt: skip
    assert frozen, "no sample saw every server process stopped"
    # Every sample in the window: all stopped (none half-paused), the CPU ticks unchanged.
    window = [(t, tree) for t, tree in samples if frozen[0][0] <= t <= frozen[-1][0]]
    assert window == frozen
    assert frozen[-1][0] - frozen[0][0] >= 2.0, "stopped for less than the 3 s window"
    assert all(tree == frozen[0][1] for _, tree in frozen), "a paused process used the CPU"
    after = [tree for t, tree in samples if t > frozen[-1][0] + 0.5]
    assert after and all(state != "T" for tree in after for state, _ in tree.values())
    paused = frozen[-1][1]
    ran_again = {
        pid for tree in after for pid, (_, ticks) in tree.items()
        if pid in paused and ticks > paused[pid][1]
    }  # fmt: skip
    assert ran_again == set(paused) - trackers, "a server process did not run after the window"
    ledger = json.loads((out / "summary.json").read_text())["ledger"]
    assert ledger["lost"] == 0 and ledger["recorded"] == ledger["scheduled"] == 48
