"""Managed targets: start the reference engine server on a free loopback port, stop it always."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import HarnessError
from harness.targets.engines import DEFAULT_MODEL
from harness.targets.process import ServerProcess, running


@dataclass(frozen=True)
class ManagedServerConfig:
    """How to launch `python -m engine_ref.serving`; `extra_args` are passed through verbatim."""

    model: str = DEFAULT_MODEL
    startup_timeout_s: float = 300.0
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.startup_timeout_s <= 0:
            raise ValueError("startup_timeout_s must be positive")


class ManagedServer(ServerProcess):
    """A running reference server (a `ServerProcess`): it binds a port of its own choosing on
    the first start, writes it to a port file and is ready once `/health` answers; engine
    faults may also slow its steps (`set_step_delay`)."""

    name = "reference engine"

    def __init__(self, config: ManagedServerConfig, workdir: Path) -> None:
        super().__init__(
            workdir / "server.log", port=None, startup_timeout_s=config.startup_timeout_s
        )
        self.config = config
        self.workdir = workdir
        self._port_file = workdir / "port"

    def _spawn(self) -> subprocess.Popen:
        self._port_file.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "engine_ref.serving",
            "--model", self.config.model, "--host", "127.0.0.1", "--port", str(self.port or 0),
            "--port-file", str(self._port_file), *self.config.extra_args,
        ]  # fmt: skip
        # The server inherits this environment as it is. OMP_WAIT_POLICY=PASSIVE, which this
        # once set, cost the thread-mode server 15% (`benchmarks/server_vs_vllm.py`, reference
        # only: 232 vs 274 output tokens/s with libgomp's default policy), since its engine's
        # OpenMP workers then sleep at every barrier.
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _ready_url(self) -> str | None:
        text = self._port_file.read_text().strip() if self._port_file.exists() else ""
        if not text:
            return None
        self.port = int(text)
        return f"http://127.0.0.1:{self.port}/health"

    def _exited_sentence(self, code: int) -> str:
        return (
            f"the reference engine server exited with code {code} before it was ready; its log ends"
        )

    def _timeout_sentence(self) -> str:
        return (
            f"the reference engine server was not healthy within "
            f"{self.startup_timeout_s:g} s; its log ends"
        )

    def set_step_delay(self, delay_ms: float) -> None:
        """Make every engine step `delay_ms` slower (0: normal again), through the server's
        fault-injection route (started with `--enable-fault-injection`)."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/admin/step_delay",
            data=json.dumps({"delay_ms": delay_ms}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            exc.close()
            raise HarnessError(
                f"the managed server refused the slow_steps fault ({exc.code}); was it started "
                "with --enable-fault-injection?"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise HarnessError(
                f"the managed server did not take the slow_steps fault: {exc}."
            ) from None


@contextlib.contextmanager
def managed_server(
    config: ManagedServerConfig, log_dir: Path | None = None
) -> Iterator[ManagedServer]:
    """Run the reference engine server for the duration of the `with` block.

    The server binds 127.0.0.1 on a port it picks and writes to a port file; we wait for
    `/health`. On failure the server's log tail is in the error; the process is stopped on every
    exit path (terminate, then kill after 10 s).
    """
    server = ManagedServer(config, Path(tempfile.mkdtemp(prefix="bench-server-")))
    if log_dir is not None:  # the run directory: the log stays with the run
        server.log_path = Path(log_dir) / "server.log"
    with running(server):
        yield server
