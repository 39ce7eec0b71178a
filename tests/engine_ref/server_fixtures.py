"""Test support: the reference server on a background thread of the test process."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from engine_ref.serving.engine_loop import EngineLoop
from engine_ref.serving.server import ServerConfig, ServerError, serve


@contextlib.contextmanager
def running_server(
    config: ServerConfig, *, engine_loop: EngineLoop | None = None, startup_timeout_s: float = 120.0
) -> Iterator[str]:
    """Run the server on a background thread with its own event loop; yields the base URL
    (use port 0 for a free port) and stops the server, engine included, on exit."""
    started = threading.Event()
    urls: list[str] = []
    errors: list[BaseException] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def on_listening(url: str) -> None:
        urls.append(url)
        started.set()

    def run() -> None:
        try:
            loop.run_until_complete(
                serve(config, on_listening=on_listening, stop=stop, engine_loop=engine_loop)
            )
        except BaseException as exc:
            errors.append(exc)
        finally:
            started.set()
            loop.close()

    thread = threading.Thread(target=run, name="engine-ref-server", daemon=True)
    thread.start()
    try:
        if not started.wait(startup_timeout_s):
            raise ServerError(f"The server did not start within {startup_timeout_s:.0f} s.")
        if errors:
            raise errors[0]
        yield urls[0]
    finally:
        if thread.is_alive():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
            thread.join(60.0)
