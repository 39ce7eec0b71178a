"""What a managed server's processes do, read from /proc while a `bench run` drives it: a sampler
that records, every 50 ms, the state and CPU ticks of each process of the reference server under
the `bench` process (the HTTP process, and with `--engine-loop process` the engine child and its
multiprocessing resource tracker), and the check that a pause stopped all of them at once."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

TRACKER = b"multiprocessing.resource_tracker"  # the engine child's helper: it sleeps


def proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, CPU ticks used) of `pid` from /proc, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], int(fields[11]) + int(fields[12])


def _descendants(root: int) -> dict[int, tuple[str, int]]:
    """{pid: (state, CPU ticks)} of every process descended from `root` (not `root`)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) is not None:
            stats[int(entry.name)] = stat
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, (ppid, _, _) in stats.items() if ppid == pid]
        tree.update({child: stats[child][1:] for child in children})
        frontier += children
    return tree


class ServerSampler:
    """Samples the reference server's processes under `bench` (a running `Popen`) until it
    exits: `samples` is [(monotonic s, {pid: (state, ticks)})], `trackers` the resource
    trackers' pids (they sleep, so they need not run again after a pause)."""

    def __init__(self, bench: subprocess.Popen, every_s: float = 0.05) -> None:
        self.bench = bench
        self.every_s = every_s
        self.samples: list[tuple[float, dict[int, tuple[str, int]]]] = []
        self.trackers: set[int] = set()
        self.cmdlines: dict[int, bytes] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.bench.poll() is None:
            serving = {}
            for pid, stat in _descendants(self.bench.pid).items():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"engine_ref.serving" in cmdline or b"multiprocessing" in cmdline:
                    serving[pid] = stat
                    self.cmdlines.setdefault(pid, cmdline.replace(b"\0", b" "))
                if TRACKER in cmdline:
                    self.trackers.add(pid)
            if serving:
                self.samples.append((time.monotonic(), serving))
            time.sleep(self.every_s)

    def join(self, timeout: float = 30) -> None:
        self._thread.join(timeout)

    def assert_one_stop_of_every_process(self, min_s: float) -> None:
        """Some samples saw every server process (at least two: HTTP and engine) in state T;
        every sample between the first and last such was so (none half-paused), for at least
        `min_s`, with no CPU tick used meanwhile (the engine took no step); afterwards every
        process but the sleeping trackers used the CPU again."""
        samples = self.samples
        assert max(len(tree) for _, tree in samples) >= 2, "no engine child: --engine-loop?"
        frozen = [
            (t, tree) for t, tree in samples
            if len(tree) >= 2 and all(state == "T" for state, _ in tree.values())
        ]  # fmt: skip
        assert frozen, "no sample saw every server process stopped"
        window = [(t, tree) for t, tree in samples if frozen[0][0] <= t <= frozen[-1][0]]
        assert window == frozen, "a sample in the pause saw a server process still running"
        assert frozen[-1][0] - frozen[0][0] >= min_s, "stopped for less than the window"
        assert all(tree == frozen[0][1] for _, tree in frozen), "a paused process used the CPU"
        paused = frozen[-1][1]
        after = [tree for t, tree in samples if t > frozen[-1][0] + 0.5]
        assert after and all(state != "T" for tree in after for state, _ in tree.values())
        ran_again = {
            pid for tree in after for pid, (_, ticks) in tree.items()
            if pid in paused and ticks > paused[pid][1]
        }  # fmt: skip
        idle = {
            pid: (
                self.cmdlines.get(pid, b"?")[:120],
                paused[pid],
                [tree.get(pid) for tree in after],
            )
            for pid in set(paused) - self.trackers - ran_again
        }  # named, so a failure says which process and what it did (a CI run once failed here)
        assert not idle, f"a process did not run after the pause: {idle}"
