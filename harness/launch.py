"""Launch an external engine from its command line, wait until it answers, stop it always.

The server runs in its own process group (vLLM starts an engine-core child), its output goes
to `server.log` in the run directory, and `stop` ends the whole group: SIGTERM, then SIGKILL
after a grace period. Ctrl-C while waiting for readiness stops it too (the caller's `with`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from harness.engines import LaunchPlan
from harness.errors import HarnessError
from harness.managed import kill_group, log_tail, signal_group, unexpected_exit

STOP_GRACE_S = 15.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the engine binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def engine_version(plan: LaunchPlan, timeout_s: float = 60.0) -> str | None:
    """The installed version of the engine's package, asked of its own interpreter (None when
    the template runs no `{python}` or the package is not installed there)."""
    if plan.python is None or not plan.spec.distributions:
        return None
    names = ", ".join(repr(d) for d in plan.spec.distributions)
    code = (
        "import importlib.metadata as m\n"
        f"for d in ({names},):\n"
        "    try:\n        print(m.version(d)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    try:
        done = subprocess.run(
            [plan.python, "-c", code], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


class CommandServer:
    """A running external engine; `kill`, `restart`, `pause`, `resume` and `unexpected_exit`
    as the reference engine's `ManagedServer` offers them, so engine faults and the run's
    watch for a dead server work on it too."""

    def __init__(self, plan: LaunchPlan, port: int, log_path: Path, startup_timeout_s: float):
        self.plan = plan
        self.port = port
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._ended_on_purpose: subprocess.Popen | None = None  # killed or stopped by us

    @property
    def name(self) -> str:
        return self.plan.spec.name

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def unexpected_exit(self) -> int | None:
        """The engine process's exit code (negative: the signal that ended it) when it ended
        without the harness asking; None while it runs or is paused, and after `kill`/`stop`."""
        return unexpected_exit(self.proc, self._ended_on_purpose)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        env = {**os.environ, **self.plan.env}
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.plan.argv)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    list(self.plan.argv),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise HarnessError(
                    f"cannot start {self.plan.spec.name} ({self.plan.argv[0]}: {exc.strerror or exc}); "
                    f"check its --engine-python or --engine-command."
                ) from exc
        self._wait_ready()

    def _wait_ready(self) -> None:
        name = self.plan.spec.name
        url = f"http://127.0.0.1:{self.port}{self.plan.spec.ready_path}"
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise HarnessError(
                    f"{name} exited with code {code} before it was ready; its log "
                    f"({self.log_path}) ends:\n{log_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                exc.close()
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise HarnessError(
            f"{name} did not answer {self.plan.spec.ready_path} within "
            f"{self.startup_timeout_s:g} s; its log ({self.log_path}) ends:\n{log_tail(self.log_path)}"
        )

    def _signal(self, sig: int) -> None:
        signal_group(self.proc, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._ended_on_purpose = self.proc
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self.start()

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        """End the process group: SIGTERM, then SIGKILL after STOP_GRACE_S. Idempotent."""
        if self.proc is None:
            return
        self._ended_on_purpose = self.proc
        self.resume()
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        kill_group(self.proc)  # children that outlived their parent (the group leader) go too


@contextlib.contextmanager
def launched(
    plan: LaunchPlan, port: int, log_path: Path, startup_timeout_s: float
) -> Iterator[CommandServer]:
    """Run the engine for the duration of the `with` block; stopped on every exit path."""
    server = CommandServer(plan, port, log_path, startup_timeout_s)
    try:
        server.start()
        yield server
    finally:
        server.stop()
