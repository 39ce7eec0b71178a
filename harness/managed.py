"""Managed targets: start the reference engine server on a free loopback port, stop it always."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import HarnessError


@dataclass(frozen=True)
class ManagedServerConfig:
    """How to launch `python -m engine_ref.serving`; `extra_args` are passed through verbatim."""

    model: str = "smollm2-135m"
    startup_timeout_s: float = 300.0
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.startup_timeout_s <= 0:
            raise ValueError("startup_timeout_s must be positive")


class ManagedServer:
    """A running reference server and what engine faults do to it (`kill`, `restart`, `pause`,
    `resume`). A restart binds the same port, so clients find it at the same URL.
    `unexpected_exit` tells a death the harness did not cause from one it did.

    The server runs in a process group of its own and every signal goes to the whole group:
    with `--engine-loop process` the engine steps in a child of the HTTP process, and a pause
    that stopped only the parent froze the streams while the engine kept stepping."""

    name = "reference engine"

    def __init__(self, config: ManagedServerConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.log_path = workdir / "server.log"
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._ended_on_purpose: subprocess.Popen | None = None  # killed or stopped by us

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, *, timeout_s: float | None = None) -> None:
        port_file = self.workdir / "port"
        port_file.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "engine_ref.serving",
            "--model", self.config.model, "--host", "127.0.0.1", "--port", str(self.port or 0),
            "--port-file", str(port_file), *self.config.extra_args,
        ]  # fmt: skip
        # The server inherits this environment as it is. OMP_WAIT_POLICY=PASSIVE, which this
        # once set, cost the thread-mode server 15% (`benchmarks/server_vs_vllm.py`, reference
        # only: 232 vs 274 output tokens/s with libgomp's default policy), since its engine's
        # OpenMP workers then sleep at every barrier.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        timeout = timeout_s if timeout_s is not None else self.config.startup_timeout_s
        self.port = _wait_ready(self.proc, port_file, self.log_path, timeout)

    def unexpected_exit(self) -> int | None:
        """The server process's exit code (negative: the signal that ended it) when it ended
        without the harness asking (`kill`, `restart`, `stop`); None while it runs or is
        paused, and after an exit the harness caused."""
        return unexpected_exit(self.proc, self._ended_on_purpose)

    def kill(self) -> None:
        """SIGKILL the server, engine child included (an engine death: nothing is flushed,
        nothing is answered)."""
        if self.proc is not None and self.proc.poll() is None:
            self._ended_on_purpose = self.proc
            signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self.start()

    def pause(self) -> None:
        """SIGSTOP to every process of the server: a hang, not a death (connections stay
        open, nothing answers, the engine does not step)."""
        signal_group(self.proc, signal.SIGSTOP)

    def resume(self) -> None:
        signal_group(self.proc, signal.SIGCONT)

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

    def stop(self) -> None:
        if self.proc is not None:
            self._ended_on_purpose = self.proc
            self.resume()
            _stop(self.proc)
            kill_group(self.proc)  # anything it left behind


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
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _wait_ready(proc: subprocess.Popen, port_file: Path, log_path: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HarnessError(
                f"the reference engine server exited with code {proc.returncode} before it was ready; its log ends:\n{log_tail(log_path)}"
            )
        if port_file.exists() and port_file.read_text().strip():
            port = int(port_file.read_text().strip())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return port
            except urllib.error.HTTPError as exc:  # up, not ready: close the answer it holds
                exc.close()
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.2)
    raise HarnessError(
        f"the reference engine server was not healthy within {timeout_s:g} s; its log ends:\n{log_tail(log_path)}"
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


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


def unexpected_exit(
    proc: subprocess.Popen | None, ended_on_purpose: subprocess.Popen | None
) -> int | None:
    """`proc`'s exit code once it ended, unless it is the process the harness ended itself."""
    if proc is None or proc is ended_on_purpose:
        return None
    return proc.poll()


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
