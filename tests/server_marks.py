"""Every test that starts a server process is marked `slow` (README, "Layout"): enforced, not
remembered.

A test not marked slow runs watched, from its setup to the end of its call: in this process and
in every Python process it starts (`listen_watch/sitecustomize.py`, put first on their
PYTHONPATH, or inherited by a fork), a socket that listens is recorded. A test whose child
process listened fails, with a sentence naming it and the fix. A server inside the test's own
process (an aiohttp test server, the fault proxy, an `http.server` thread) is allowed: it costs
milliseconds, where a server process costs an interpreter, its imports and often an engine.
A test marked slow is not watched. The hooks are imported by `conftest.py`.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

WATCH_DIR = Path(__file__).parent / "listen_watch"
_spec = importlib.util.spec_from_file_location("listen_watch", WATCH_DIR / "sitecustomize.py")
listen_watch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(listen_watch)

_WATCH = pytest.StashKey[tuple]()  # (log path, stop the in-process watch, environment before)


def _start(item: pytest.Item) -> None:
    descriptor, path = tempfile.mkstemp(prefix="listens-", suffix=".log")
    os.close(descriptor)
    log = Path(path)
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", listen_watch.LOG_ENV)}
    os.environ[listen_watch.LOG_ENV] = str(log)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WATCH_DIR), saved["PYTHONPATH"]]))
    item.stash[_WATCH] = (log, listen_watch.watch(str(log)), saved)


def _stop(item: pytest.Item) -> None:
    watched = item.stash.get(_WATCH, None)
    if watched is None:
        return
    del item.stash[_WATCH]
    log, stop, saved = watched
    stop()
    log.unlink(missing_ok=True)
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _fail_if_a_child_listened(item: pytest.Item) -> None:
    log, _, _ = item.stash[_WATCH]
    listens = [line.split("\t") for line in log.read_text(encoding="utf-8").splitlines()]
    servers = [f"pid {pid} ({command}): {what}" for pid, command, what in listens
               if int(pid) != os.getpid()]  # fmt: skip
    if servers:
        more = len(servers) - 3
        shown = "; ".join(servers[:3]) + (f"; and {more} more" if more > 0 else "")
        pytest.fail(
            f"{item.nodeid} started a server process but is not marked slow ({shown}): add "
            "@pytest.mark.slow to it (README, Layout: a test that starts a server process is slow).",
            pytrace=False,
        )


def _watched(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if _watched(item):
        _start(item)
    result = yield
    if _watched(item):
        _fail_if_a_child_listened(item)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    if _watched(item):
        _fail_if_a_child_listened(item)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    # after the fixtures' teardown, so a monkeypatched environment is undone before ours
    try:
        return (yield)
    finally:
        _stop(item)
