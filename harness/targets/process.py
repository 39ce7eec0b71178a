"""`ServerProcess`: every server the harness starts (the reference engine, an external engine),
stopped on every exit path, and what engine faults do to it.

The server leads a process group of its own (`start_new_session`) and every signal goes to the
whole group: an engine may step in a child of its HTTP process (the reference engine's
`--engine-loop process`, vLLM's engine core), and a pause that stopped only the parent froze the
streams while the engine kept stepping.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

from harness.errors import HarnessError

READY_POLL_S = 0.2  # how often a starting server is asked whether it is ready
KILL_WAIT_S = 30.0  # how long a SIGKILLed group leader may take to be reaped


class ServerProcess:
    """A running server the harness started: `start`, `stop` (idempotent), and the engine
    faults `kill`, `restart`, `pause`, `resume`. A restart binds the same port, so clients find
    it at the same URL. `unexpected_exit` tells a death the harness did not cause from one it
    did.

    A subclass says how the process is started (`_spawn`) and where it answers once ready
    (`_ready_url`; None while it cannot tell yet), and words its failures
    (`_exited_sentence`, `_timeout_sentence`). `stop` sends SIGTERM to the group leader, or
    with `term_group` to the whole group, then SIGKILL to the group after `stop_grace_s`."""

    name = "server"
    stop_grace_s = 10.0
    term_group = False

    def __init__(self, log_path: Path, *, port: int | None, startup_timeout_s: float) -> None:
        self.log_path = Path(log_path)
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._ended_on_purpose: subprocess.Popen | None = None  # killed or stopped by us

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _spawn(self) -> subprocess.Popen:
        raise NotImplementedError

    def _ready_url(self) -> str | None:
        raise NotImplementedError

    def _exited_sentence(self, code: int) -> str:
        return (
            f"{self.name} exited with code {code} before it was ready; its log "
            f"({self.log_path}) ends"
        )

    def _timeout_sentence(self) -> str:
        return (
            f"{self.name} was not ready within {self.startup_timeout_s:g} s; its log "
            f"({self.log_path}) ends"
        )

    def start(self) -> None:
        """Start the process and wait until it answers 200 at its ready URL. A process that
        exits first, or does not answer within `startup_timeout_s`, is a `HarnessError`
        ending with the last lines of its log."""
        self.proc = self._spawn()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise HarnessError(f"{self._exited_sentence(code)}:\n{log_tail(self.log_path)}")
            url = self._ready_url()
            if url is not None and answers_ok(url):
                return
            time.sleep(READY_POLL_S)
        raise HarnessError(f"{self._timeout_sentence()}:\n{log_tail(self.log_path)}")

    def unexpected_exit(self) -> int | None:
        """The server process's exit code (negative: the signal that ended it) when it ended
        without the harness asking (`kill`, `restart`, `stop`); None while it runs or is
        paused, and after an exit the harness caused."""
        if self.proc is None or self.proc is self._ended_on_purpose:
            return None
        return self.proc.poll()

    def kill(self) -> None:
        """SIGKILL every process of the server (an engine death: nothing is flushed, nothing
        is answered)."""
        if self.proc is not None and self.proc.poll() is None:
            self._ended_on_purpose = self.proc
            signal_group(self.proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=KILL_WAIT_S)

    def restart(self, delay_s: float = 0.0) -> None:
        """`kill`, wait `delay_s`, `start` again on the same port; `restarts` counts the
        restarts that came up (a failed start raises, as `start` does)."""
        self.kill()
        if delay_s > 0:
            time.sleep(delay_s)
        self.start()
        self.restarts += 1

    def pause(self) -> None:
        """SIGSTOP to every process of the server: a hang, not a death (connections stay
        open, nothing answers, the engine does not step)."""
        signal_group(self.proc, signal.SIGSTOP)

    def resume(self) -> None:
        signal_group(self.proc, signal.SIGCONT)

    def stop(self) -> None:
        """End the server: SIGTERM (see the class docstring), SIGKILL to the group after
        `stop_grace_s`, and SIGKILL to whatever of the group outlived its leader. Idempotent."""
        if self.proc is None:
            return
        self._ended_on_purpose = self.proc
        self.resume()
        if self.proc.poll() is None:
            if self.term_group:
                signal_group(self.proc, signal.SIGTERM)
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                signal_group(self.proc, signal.SIGKILL)
                self.proc.wait(timeout=KILL_WAIT_S)
        kill_group(self.proc)


Server = TypeVar("Server", bound=ServerProcess)


@contextlib.contextmanager
def running(server: Server) -> Iterator[Server]:
    """`server` started for the duration of the `with` block and stopped on every exit path
    (a failed start and Ctrl-C while it starts included)."""
    try:
        server.start()
        yield server
    finally:
        server.stop()


def answers_ok(url: str, timeout_s: float = 2.0) -> bool:
    """GET `url` answers 200 (an error answer, a refused connection or no answer: False)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except urllib.error.HTTPError as exc:  # up, not ready: close the answer it holds
        exc.close()
    except (urllib.error.URLError, OSError):
        pass
    return False


def signal_group(proc: subprocess.Popen | None, sig: int) -> None:
    """`sig` to every process of `proc`'s process group (it leads one: started with
    `start_new_session`), while `proc` itself runs."""
    if proc is not None and proc.poll() is None:
        kill_group(proc, sig)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """`sig` to `proc`'s process group whether or not `proc` still runs: children that
    outlived their parent go too. A group already gone is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def exit_description(returncode: int) -> str:
    """`SIGSEGV` for a process a signal ended (Popen's negative code), else `code 1`."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


LOG_TAIL_BYTES = 64 * 1024  # a long-running engine's log can be large; its end is enough


def log_tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a server log (\"(no log)\" when it cannot be read); only
    its last LOG_TAIL_BYTES are read."""
    try:
        with open(path, "rb") as log:
            size = log.seek(0, 2)
            log.seek(max(0, size - LOG_TAIL_BYTES))
            text = log.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
