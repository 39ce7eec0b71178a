"""Launch an external engine from its command line, wait until it answers, stop it always.

The server runs in its own process group (vLLM starts an engine-core child), its output goes
to `server.log` in the run directory, and `stop` ends the whole group: SIGTERM, then SIGKILL
after a grace period. Ctrl-C while waiting for readiness stops it too (the caller's `with`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from harness.errors import HarnessError
from harness.targets.engines import LaunchPlan
from harness.targets.process import ServerProcess, running

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


class CommandServer(ServerProcess):
    """A running external engine (a `ServerProcess`): started from its launch plan's command
    line on the port the plan chose, ready once its `ready_path` answers 200, so engine faults
    and the run's watch for a dead server work on it as on the reference engine. `stop` sends
    SIGTERM to the whole group (vLLM's engine core too)."""

    stop_grace_s = STOP_GRACE_S
    term_group = True

    def __init__(self, plan: LaunchPlan, port: int, log_path: Path, startup_timeout_s: float):
        super().__init__(log_path, port=port, startup_timeout_s=startup_timeout_s)
        self.plan = plan

    @property
    def name(self) -> str:
        return self.plan.spec.name

    def _spawn(self) -> subprocess.Popen:
        env = {**os.environ, **self.plan.env}
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.plan.argv)}\n".encode())
            log.flush()
            try:
                return subprocess.Popen(
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

    def _ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.plan.spec.ready_path}"

    def _timeout_sentence(self) -> str:
        return (
            f"{self.name} did not answer {self.plan.spec.ready_path} within "
            f"{self.startup_timeout_s:g} s; its log ({self.log_path}) ends"
        )


@contextlib.contextmanager
def launched(
    plan: LaunchPlan, port: int, log_path: Path, startup_timeout_s: float
) -> Iterator[CommandServer]:
    """Run the engine for the duration of the `with` block; stopped on every exit path."""
    with running(CommandServer(plan, port, log_path, startup_timeout_s)) as server:
        yield server
