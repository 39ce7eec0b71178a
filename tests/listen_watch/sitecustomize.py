"""Records every listening socket a process opens, for `tests/server_marks.py`.

While a test not marked slow runs, this folder is first on PYTHONPATH and `LOG_ENV` names a
file, so every Python process the test starts imports this module at startup and watches
itself; the test's own process loads it too (so that processes it forks are watched). Each
listen appends one line to the file: the process id, its command line and the address, tab
separated. Nothing is refused here (a server's own error handling might swallow that); the
test fails afterwards, with a sentence naming the fix.

Two ways to listen are watched: `socket.socket.listen` (asyncio's servers, aiohttp on asyncio,
`http.server`, a bare socket) and uvloop's `create_server` / `create_unix_server`, which listen
in libuv without calling it (the reference engine serves on uvloop). uvloop is patched when it
is imported, so a process that never uses it does not pay for importing it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import socket
import sys
from collections.abc import Callable

LOG_ENV = "BENCH_TEST_LISTEN_LOG"
UVLOOP_SERVERS = ("create_server", "create_unix_server")


def watch(log_path: str) -> Callable[[], None]:
    """Start recording this process's listens into `log_path`; returns the function that stops."""

    def record(what: str) -> None:
        command = " ".join(sys.argv)[:160].replace("\t", " ")
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"{os.getpid()}\t{command}\t{what}\n")

    original_listen = socket.socket.listen

    def listen(self: socket.socket, *args: int) -> None:
        record(f"listen() on {self.getsockname()!r}")
        return original_listen(self, *args)

    socket.socket.listen = listen  # type: ignore[method-assign]
    undo: list[Callable[[], None]] = [lambda: setattr(socket.socket, "listen", original_listen)]

    def patch_uvloop(uvloop) -> None:
        loop_class = uvloop.Loop  # a Python subclass of the compiled loop: it takes attributes
        for name in UVLOOP_SERVERS:
            own = loop_class.__dict__.get(name)
            inherited = getattr(loop_class, name)

            async def serve(self, *args, _inherited=inherited, _name=name, **kwargs):
                server = await _inherited(self, *args, **kwargs)
                record(f"uvloop {_name} on {[s.getsockname() for s in server.sockets]!r}")
                return server

            setattr(loop_class, name, serve)
            if own is None:
                undo.append(lambda name=name: delattr(loop_class, name))
            else:
                undo.append(lambda name=name, own=own: setattr(loop_class, name, own))

    if "uvloop" in sys.modules:
        patch_uvloop(sys.modules["uvloop"])
    else:
        finder = _AfterImport("uvloop", patch_uvloop)
        sys.meta_path.insert(0, finder)
        undo.append(lambda: finder in sys.meta_path and sys.meta_path.remove(finder))

    def stop() -> None:
        for step in reversed(undo):
            step()

    return stop


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once module `name` has been imported (through the path finder)."""

    def __init__(self, name: str, then: Callable) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then(module) -> None:
            exec_module(module)
            self.then(module)

        spec.loader.exec_module = exec_then  # this spec's own loader instance
        return spec


if os.environ.get(LOG_ENV):
    watch(os.environ[LOG_ENV])
