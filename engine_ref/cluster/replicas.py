"""The worker processes behind the router: N ordinary reference servers on loopback.

A worker is the single server (`engine_ref.serving.server.serve`) run in a process spawned as
the engine's own process mode spawns its engine (`engine_process`): a fresh interpreter, so no
torch state or threads are inherited, built from the same frozen `ServerConfig` the CLI made
(port 0 on 127.0.0.1), so every engine and server option applies to each worker unchanged. The
worker reports its URL over a pipe once it listens (its engine is built by then) and the
parent then checks its /health.

Each worker runs on its own share of the router's CPUs (`worker_cpus`, set before torch loads,
so the engine sizes its threads to that share): N engines each sizing their threads to every
core would oversubscribe the host many times over (tiny-random on 2 cores, 2 workers: about
250 ms per decode step unpinned against about 1 ms pinned).

Nothing outlives the router: `stop_workers` sends SIGTERM (the server stops cleanly, its
engine process included), waits, then kills; a worker whose router died without stopping it
(SIGKILL) notices within a second and stops itself; Ctrl-C, which reaches the whole process
group, is ignored by workers so the router alone decides when they stop. A worker that dies is
reported to `LocalWorker.watch`'s callback the moment its process exits (its sentinel).

`start_workers` is the one function that places workers; placing them elsewhere (Ray actors)
means another function returning objects with `LocalWorker`'s public attributes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from engine_ref.serving.server import ServerConfig, ServerError, serve

LOG = logging.getLogger("engine_ref.cluster.replicas")
STOP_GRACE_S = 30.0  # a worker's server gives streams 2 s, then closes its engine


class LocalWorker:
    """One worker process on this host: its index, base URL and process."""

    def __init__(self, index: int, url: str, process: BaseProcess) -> None:
        self.index = index
        self.url = url
        self.process = process

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def exit_description(self) -> str:
        """How the process ended, as a phrase ("exited with code 1", "was killed by SIGKILL");
        "is running" while it runs."""
        return describe_exit(self.process.exitcode)

    def watch(self, on_exit: Callable[[LocalWorker], None]) -> None:
        """Call `on_exit(self)` on the running event loop once the process exits (until
        `unwatch`)."""
        loop = asyncio.get_running_loop()

        def exited() -> None:
            self.unwatch()
            self.process.join(1.0)  # reap it (it has exited), so exitcode is known
            on_exit(self)

        loop.add_reader(self.process.sentinel, exited)

    def unwatch(self) -> None:
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().remove_reader(self.process.sentinel)

    def stop(self) -> None:
        """SIGTERM (the server stops cleanly); see `stop_workers` for the wait."""
        if self.process.is_alive():
            self.process.terminate()

    def kill(self) -> None:
        """SIGKILL (a fault plan's dead worker)."""
        self.process.kill()


def describe_exit(code: int | None) -> str:
    """A process's end from its exit code, as a phrase ("exited with code 1", "was killed by
    SIGKILL"); "is running" for None."""
    if code is None:
        return "is running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


Serving = Callable[[ServerConfig, asyncio.Event, Callable[[object], None]], Awaitable[None]]


def serve_single(
    config: ServerConfig, stop: asyncio.Event, on_listening: Callable[[object], None]
) -> Awaitable[None]:
    """A worker's default serving: the single server, reporting its URL once it listens."""
    return serve(config, on_listening=on_listening, stop=stop)


def spawn_workers(
    config: ServerConfig,
    servings: list[Serving],
    *,
    log_level: str = "warning",
    startup_timeout_s: float = 600.0,
) -> list[tuple[BaseProcess, object]]:
    """One worker process per entry of `servings` (a picklable callable: a module-level
    function, or a `functools.partial` of one), each serving `config` with its host, port and
    port file replaced by 127.0.0.1, a free port and none, on its share of the CPUs. Returns
    (process, what it reported once listening: its URL, or a tuple starting with it) once each
    answers /health. Blocking; on any failure every worker started is stopped and ServerError
    says which failed and how."""
    worker_config = dataclasses.replace(config, host="127.0.0.1", port=0, port_file=None)
    context = multiprocessing.get_context("spawn")
    pending: list[tuple[BaseProcess, Connection]] = []
    started: list[tuple[BaseProcess, object]] = []
    try:
        for index, serving in enumerate(servings):
            reader, writer = context.Pipe(duplex=False)
            # Not a daemon: a worker in process mode starts its own engine process.
            process = context.Process(
                target=worker_main,
                args=(worker_config, writer, log_level, worker_cpus(index, len(servings)), serving),
                name=f"engine-worker-{index}",
            )
            process.start()
            writer.close()  # so the pipe reports EOF once the child is gone
            pending.append((process, reader))
        deadline = time.monotonic() + startup_timeout_s
        for index, (process, reader) in enumerate(pending):
            reported = await_url(index, process, reader, deadline)
            url = reported if isinstance(reported, str) else reported[0]
            await_health(index, url, deadline)
            started.append((process, reported))
    except BaseException:
        stop_workers([LocalWorker(i, "", p) for i, (p, _) in enumerate(pending)])
        raise
    finally:
        for _, reader in pending:
            reader.close()
    return started


def start_workers(
    config: ServerConfig,
    replicas: int,
    *,
    log_level: str = "warning",
    startup_timeout_s: float = 600.0,
) -> list[LocalWorker]:
    """`replicas` single-server workers (`spawn_workers`), once each answers /health."""
    spawned = spawn_workers(
        config, [serve_single] * replicas, log_level=log_level, startup_timeout_s=startup_timeout_s
    )
    return [LocalWorker(index, url, process) for index, (process, url) in enumerate(spawned)]


def stop_workers(workers: list[LocalWorker], *, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every worker, wait up to `grace_s` for all, then SIGKILL what is left."""
    for worker in workers:
        worker.stop()
    deadline = time.monotonic() + grace_s
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.process.is_alive():
            LOG.warning("worker %d did not stop within %.0f s: killed", worker.index, grace_s)
            worker.process.kill()
            worker.process.join(5.0)


def await_url(index: int, process: BaseProcess, reader: Connection, deadline: float) -> object:
    while time.monotonic() < deadline:
        if reader.poll(0.5):
            try:
                kind, payload = reader.recv()
            except (EOFError, OSError):
                break
            if kind == "listening":
                return payload
            raise ServerError(f"Worker {index} failed to start: {payload}")
        if not process.is_alive():
            break
    process.join(0)
    if process.exitcode is None:
        raise ServerError(f"Worker {index} did not start in time.")
    raise ServerError(f"Worker {index} exited with code {process.exitcode} while starting.")


def await_health(index: int, url: str, deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5.0) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ServerError(f"Worker {index} at {url} did not become healthy in time.")
        time.sleep(0.1)


def worker_cpus(index: int, replicas: int) -> set[int] | None:
    """The CPUs worker `index` of `replicas` runs on: a contiguous share of this process's
    CPUs (the first shares one larger when they do not divide evenly; one CPU, shared round
    robin, when there are more workers than CPUs). None where affinity cannot be set."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if replicas > len(cpus):
        return {cpus[index % len(cpus)]}
    base, extra = divmod(len(cpus), replicas)
    start = index * base + min(index, extra)
    return set(cpus[start : start + base + (index < extra)])


def pin(cpus: set[int]) -> None:
    """Run this process on `cpus` only, torch's threads on this thread counted to match."""
    os.sched_setaffinity(0, cpus)
    if "torch" in sys.modules:  # imported before the pinning: it counted every core
        # The event loop's own torch work (a P/D receiver's landing writes) otherwise ran with
        # an OpenMP team of all the machine's cores on this worker's one: a 2,048-token
        # SmolLM2 landing took 14 ms of the receiver's core instead of about 5.
        sys.modules["torch"].set_num_threads(len(cpus))


def worker_main(
    config: ServerConfig,
    writer: Connection,
    log_level: str,
    cpus: set[int] | None,
    serving: Serving = serve_single,
) -> None:
    """Entry point of a worker process: `serving` serves `config` until SIGTERM or the
    parent's death."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cpus is not None:
        pin(cpus)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s worker %(name)s %(message)s")
    try:
        try:
            import uvloop  # as `bench serve` runs the single server: faster socket writes
        except ImportError:
            asyncio.run(_serve_until_stopped(config, writer, serving))
        else:
            uvloop.run(_serve_until_stopped(config, writer, serving))
    except Exception as exc:  # the parent turns this into one sentence
        with contextlib.suppress(OSError):
            writer.send(("failed", str(exc) or type(exc).__name__))
    finally:
        writer.close()


async def _serve_until_stopped(config: ServerConfig, writer: Connection, serving: Serving) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    parent = multiprocessing.parent_process()

    async def stop_when_orphaned() -> None:
        while parent is None or parent.is_alive():
            await asyncio.sleep(1.0)
        stop.set()

    orphan_watch = asyncio.create_task(stop_when_orphaned())
    try:
        await serving(config, stop, lambda reported: writer.send(("listening", reported)))
    finally:
        orphan_watch.cancel()
