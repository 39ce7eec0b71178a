"""Fixtures for harness tests: a mock engine server in a subprocess on a free loopback port."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time

import pytest


@contextlib.contextmanager
def mock_server_process(*args: str, timeout_s: float = 20.0):
    """Start `bench mock-server` with `args` on a free port; yield its base URL (…/v1)."""
    cmd = [sys.executable, "-m", "harness.cli", "mock-server", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        url = None
        while time.monotonic() < deadline and url is None:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"mock server exited with {proc.returncode}")
            match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if match:
                url = match.group(1) + "/v1"
        if url is None:
            raise RuntimeError("mock server did not start in time")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()


@pytest.fixture
def mock_server():
    """Factory fixture: `with mock_server("--ttft-ms", "5") as url: ...`."""
    return mock_server_process
