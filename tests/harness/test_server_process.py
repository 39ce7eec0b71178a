"""`ServerProcess`, the base of every server the harness starts, on a child that listens on
nothing (a sleeping Python): deaths it caused are not unexpected, one it did not is, a restart
counts once it came up, a process that exits before it is ready is one sentence with its log,
and `stop` is idempotent and ends the whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from proc_tree import proc_stat

from harness.errors import HarnessError
from harness.targets import process
from harness.targets.process import ServerProcess, running

SLEEP = (  # a process with one child, both asleep
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
)


class Sleeper(ServerProcess):
    """A 'server' whose process (with one child) sleeps; ready as soon as it runs, or never
    (`ready=False`)."""

    name = "sleeper"
    stop_grace_s = 5.0

    def __init__(self, log_path, code: str = SLEEP, *, ready: bool = True) -> None:
        super().__init__(log_path, port=1, startup_timeout_s=5.0)
        self.code, self.ready = code, ready

    def _spawn(self) -> subprocess.Popen:
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-c", self.code], stdout=log, stderr=log, start_new_session=True
            )

    def _ready_url(self) -> str | None:
        return "http://ready" if self.ready else None


@pytest.fixture(autouse=True)
def _ready_at_once(monkeypatch):
    monkeypatch.setattr(process, "answers_ok", lambda url: True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_kill_and_restart_are_on_purpose_a_foreign_kill_is_not(tmp_path):
    with running(Sleeper(tmp_path / "server.log")) as server:
        assert server.unexpected_exit() is None and server.base_url == "http://127.0.0.1:1/v1"
        first = server.pid
        server.restart(delay_s=0.05)
        assert server.restarts == 1 and server.pid != first
        assert server.unexpected_exit() is None
        server.kill()
        assert server.unexpected_exit() is None  # the harness ended it
        server.start()
        os.killpg(server.pid, signal.SIGKILL)  # not the harness
        server.proc.wait(timeout=10)
        assert server.unexpected_exit() == -signal.SIGKILL


def test_pause_stops_the_group_and_stop_ends_it_all(tmp_path):
    server = Sleeper(tmp_path / "server.log")
    with running(server):
        server.pause()
        time.sleep(0.2)
        assert proc_stat(server.pid)[1] == "T"
        pgid = server.pid
    assert server.unexpected_exit() is None and not _group_alive(pgid)
    server.stop()  # idempotent


def test_a_server_that_exits_before_it_is_ready_is_one_sentence_with_its_log(tmp_path):
    code = "import sys; print('bad flag --x'); sys.exit(3)"
    with pytest.raises(HarnessError) as info:
        with running(Sleeper(tmp_path / "server.log", code, ready=False)):
            pass
    message = str(info.value)
    assert message.startswith("sleeper exited with code 3 before it was ready; its log (")
    assert message.endswith("bad flag --x")
