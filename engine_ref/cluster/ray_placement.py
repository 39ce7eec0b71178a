"""Workers placed as Ray actors (`bench serve --replicas N --ray ADDRESS`, and the P/D workers
of `--prefill-workers P --decode-workers D --ray ADDRESS`: `pd_procs`; issue 27 item 4).

The router, its policies and the KV links do not change: a worker is still the single server
(`replicas.worker_main`) in a process of its own, reached over HTTP. What changes is where
that process starts. Each worker is an actor (one CPU, spread over the cluster's nodes); the
actor starts the server process on its node, listening on the node's address (the address
Ray itself uses for it), and returns the URL once the server answers /health. The router then
talks to the URL as to a local worker.

`RayWorker` has `replicas.LocalWorker`'s public face (index, url, alive, exit_description,
watch, unwatch, stop), so the router treats both alike. A worker's death is seen by awaiting
the actor's `wait_exit` (it returns when the server process ends) or by Ray reporting the
actor dead (its node went away); either way the router's callback runs once, as for a local
worker's process sentinel.

Ray is the optional `ray` extra (as for `bench run --ray`); without it `--ray` is one
sentence naming the extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable

from engine_ref.cluster.replicas import (
    STOP_GRACE_S,
    Serving,
    await_health,
    await_url,
    describe_exit,
    serve_single,
    worker_main,
)
from engine_ref.serving.server import ServerConfig, ServerError

LOG = logging.getLogger("engine_ref.cluster.ray_placement")
INSTALL_SENTENCE = (
    "--ray needs Ray, which is not installed; install the extra: "
    "pip install 'llm-bench-harness[ray]'."
)


def require_ray():
    """The `ray` module; ServerError naming the extra when it is not installed."""
    try:
        import ray
    except ImportError:
        raise ServerError(INSTALL_SENTENCE) from None
    return ray


def connect(address: str) -> None:
    """Join (or, for `local`, start) the Ray cluster at `address`; one sentence when not."""
    ray = require_ray()
    if ray.is_initialized():
        return
    try:
        ray.init(
            address=address,
            log_to_driver=False,
            logging_level=logging.WARNING,
            include_dashboard=False if address == "local" else None,
        )
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise ServerError(
            f"Cannot reach the Ray cluster at {address!r} ({exc}); start one with "
            "`ray start --head`, or use --ray local."
        ) from None


class EngineWorkerActor:
    """A Ray actor that runs one worker server process on its node (module doc). Threaded
    (`max_concurrency`), so `wait_exit` can block while `stop` is called."""

    def __init__(self) -> None:
        self._process = None
        self._exited = threading.Event()

    def start(
        self, config: ServerConfig, index: int, log_level: str, timeout_s: float,
        serving: Serving = serve_single,
    ) -> dict:  # fmt: skip
        """Start the worker's server process (`serving`, as `replicas.spawn_workers` takes
        it) on this node's address; what it reported once listening (its URL, or a tuple
        starting with it: a P/D decode worker's adds its KV port) once it answers /health."""
        import ray

        host = ray.util.get_node_ip_address()
        config = dataclasses.replace(config, host=host, port=0, port_file=None)
        context = multiprocessing.get_context("spawn")
        reader, writer = context.Pipe(duplex=False)
        self._process = context.Process(
            target=worker_main,
            args=(config, writer, log_level, None, serving),
            name=f"engine-worker-{index}",
        )
        self._process.start()
        writer.close()
        try:
            deadline = time.monotonic() + timeout_s
            reported = await_url(index, self._process, reader, deadline)
            url = reported if isinstance(reported, str) else reported[0]
            await_health(index, url, deadline)
        except BaseException:
            self.stop()
            raise
        finally:
            reader.close()
        return {
            "url": url,
            "reported": reported,
            "node": ray.get_runtime_context().get_node_id(),
            "pid": self._process.pid,
        }

    def kill(self) -> None:
        """SIGKILL the server process (a fault plan's dead worker); `wait_exit` then returns."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()

    def wait_exit(self) -> str:
        """Block until the server process ends; how it ended."""
        self._process.join()
        self._exited.set()
        return describe_exit(self._process.exitcode)

    def stop(self, grace_s: float = STOP_GRACE_S) -> str:
        process = self._process
        if process is None:
            return "never started"
        if process.is_alive():
            process.terminate()
            process.join(grace_s)
        if process.is_alive():
            process.kill()
            process.join(5.0)
        return describe_exit(process.exitcode)


class RayWorker:
    """One worker placed by Ray: `replicas.LocalWorker`'s public face over an actor."""

    def __init__(self, index: int, url: str, node: str, actor, reported: object = None) -> None:
        self.index, self.url, self.node, self.actor = index, url, node, actor
        self.reported = url if reported is None else reported  # what it said once listening
        self.pid = None  # on another node, possibly: not this host's to signal
        self._ended: str | None = None
        self._watch: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self._ended is None

    def exit_description(self) -> str:
        return self._ended or "is running"

    def watch(self, on_exit: Callable[[RayWorker], None]) -> None:
        """Call `on_exit(self)` on the running event loop once the server process exits or
        the actor dies (until `unwatch`)."""

        async def waiting() -> None:
            try:
                how = await self.actor.wait_exit.remote()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the actor (or its node) died: Ray says how
                how = f"was lost with its Ray actor ({type(exc).__name__})"
            self._ended = how
            on_exit(self)

        self._watch = asyncio.get_running_loop().create_task(waiting())

    def unwatch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def kill(self) -> None:
        """SIGKILL the server process on its node; `watch` reports the exit."""
        self.actor.kill.remote()

    def stop(self) -> None:
        """Stop the server process and the actor (blocking up to the grace period)."""
        stop_actor(self.actor)
        if self._ended is None:
            self._ended = "was stopped"


def stop_actor(actor) -> None:
    """Stop an actor's server process (its grace period), then the actor; what Ray raises
    for an actor already gone is ignored."""
    import ray

    with contextlib.suppress(Exception):
        ray.get(actor.stop.remote(), timeout=STOP_GRACE_S + 10)
    with contextlib.suppress(Exception):
        ray.kill(actor)


def start_ray_workers(
    config: ServerConfig,
    replicas: int,
    address: str,
    *,
    log_level: str = "warning",
    startup_timeout_s: float = 600.0,
    servings: list[Serving] | None = None,
) -> list[RayWorker]:
    """Start `replicas` workers as Ray actors spread over the cluster at `address` and return
    them once each answers /health; on any failure every one started is stopped and
    ServerError says which failed and how. `servings`: what each serves (as
    `replicas.spawn_workers` takes them: the P/D workers' roles), default the single server."""
    ray = require_ray()
    connect(address)
    servings = servings or [serve_single] * replicas
    actor_class = ray.remote(num_cpus=1, max_concurrency=4)(EngineWorkerActor)
    actors = [actor_class.options(scheduling_strategy="SPREAD").remote() for _ in servings]
    started = [
        a.start.remote(config, i, log_level, startup_timeout_s, servings[i])
        for i, a in enumerate(actors)
    ]
    workers: list[RayWorker] = []
    try:
        for index, (actor, ref) in enumerate(zip(actors, started, strict=True)):
            try:
                info = ray.get(ref, timeout=startup_timeout_s + 30)
            except Exception as exc:
                cause = getattr(exc, "cause", None) or exc
                raise ServerError(f"Worker {index} failed to start on Ray: {cause}") from None
            workers.append(RayWorker(index, info["url"], info["node"], actor, info["reported"]))
    except BaseException:
        for actor in actors:
            stop_actor(actor)
        raise
    return workers


def stop_ray_workers(workers: list[RayWorker]) -> None:
    for worker in workers:
        worker.stop()
