"""Negative control for `server_marks.py`: in a pytest run of a small generated file, a test
not marked slow that starts a server process (a child listening on a bare socket or on uvloop,
a forked child, one a fixture starts) fails with a sentence naming the fix; marked slow it
passes, and so does one serving inside its own process (a socket, aiohttp) or starting a child
that serves nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_marks import listen_watch

# Marked slow itself: the run it starts starts server processes, and takes a few seconds.
pytestmark = pytest.mark.slow

TESTS_DIR = Path(__file__).parent

CONFTEST = f"""
import sys

sys.path.insert(0, {str(TESTS_DIR)!r})
from server_marks import pytest_runtest_call, pytest_runtest_setup, pytest_runtest_teardown


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts a server")
"""

GENERATED = '''
import asyncio
import multiprocessing
import socket
import subprocess
import sys

import pytest
from aiohttp import web

LISTEN = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()"
UVLOOP = """
import asyncio, uvloop
async def main():
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, '127.0.0.1', 0)
    server.close()
uvloop.run(main())
"""


def listen():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()


def test_socket_in_process():
    listen()


def test_aiohttp_in_process():
    async def serve():
        runner = web.AppRunner(web.Application())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        await runner.cleanup()

    asyncio.run(serve())


def test_child_unmarked():
    subprocess.run([sys.executable, "-c", LISTEN], check=True)


@pytest.mark.slow
def test_child_marked():
    subprocess.run([sys.executable, "-c", LISTEN], check=True)


def test_child_on_uvloop_unmarked():
    subprocess.run([sys.executable, "-c", UVLOOP], check=True)


def test_forked_child_unmarked():
    child = multiprocessing.get_context("fork").Process(target=listen)
    child.start()
    child.join()
    assert child.exitcode == 0


@pytest.fixture
def server():
    subprocess.run([sys.executable, "-c", LISTEN], check=True)


def test_fixture_unmarked(server):
    pass


def test_bind_only():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))


def test_child_serving_nothing():
    subprocess.run([sys.executable, "-c", "import asyncio, uvloop"], check=True)
'''

EXPECTED = {
    "test_socket_in_process": "PASSED",
    "test_aiohttp_in_process": "PASSED",
    "test_child_unmarked": "FAILED",
    "test_child_marked": "PASSED",
    "test_child_on_uvloop_unmarked": "FAILED",
    "test_forked_child_unmarked": "FAILED",
    "test_fixture_unmarked": "ERROR",  # at setup
    "test_bind_only": "PASSED",
    "test_child_serving_nothing": "PASSED",
}


def test_unmarked_tests_that_start_a_server_fail(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_generated.py").write_text(GENERATED)
    env = {k: v for k, v in os.environ.items() if k != listen_watch.LOG_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_generated.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    summary = re.findall(r"^(PASSED|FAILED|ERROR) test_generated\.py::(\w+)", result.stdout, re.M)
    outcomes = {name: outcome for outcome, name in summary}
    assert outcomes == EXPECTED, result.stdout
    fixes = re.findall(r"test_generated\.py::(\w+) started a server process but is not marked "
                       r"slow \(pid \d+ .*\): add @pytest\.mark\.slow to it", result.stdout)  # fmt: skip
    assert sorted(set(fixes)) == sorted(n for n, o in EXPECTED.items() if o != "PASSED"), (
        result.stdout
    )
