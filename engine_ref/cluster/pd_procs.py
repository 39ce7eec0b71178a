"""The P/D cluster's worker processes: prefill workers, then decode workers, each a
`pd_worker` server in a process of its own, placed as `replicas` places the router's
workers (spawned, on its share of the CPUs, stopped by `replicas.stop_workers`).

A worker reports its URL and, for a decode worker, its KV receiver's port over a pipe once it
listens; `PDProcess` carries both, and its role, beside `LocalWorker`'s attributes.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from multiprocessing.process import BaseProcess
from urllib.parse import urlsplit

from engine_ref.cluster.pd_worker import serve_worker
from engine_ref.cluster.ray_placement import RayWorker, start_ray_workers, stop_ray_workers
from engine_ref.cluster.replicas import LocalWorker, spawn_workers, stop_workers
from engine_ref.serving.server import ServerConfig

__all__ = ["PDProcess", "RayPDWorker", "start_pd_workers", "stop_pd_workers"]


class _KVAddress:
    """A P/D worker's KV receiver address: it listens on its server's host (`kv_port`: None
    for a prefill worker)."""

    url: str
    kv_port: int | None

    @property
    def kv_host(self) -> str | None:
        return urlsplit(self.url).hostname


class PDProcess(_KVAddress, LocalWorker):
    """A P/D worker process: `role` "prefill" or "decode", `kv_port` its KV receiver's port
    (decode workers only) on `kv_host` (its server's host), `name` its role and index within
    the role (`decode-0`)."""

    def __init__(
        self, index: int, url: str, process: BaseProcess, role: str, kv_port: int | None,
        name: str,
    ) -> None:  # fmt: skip
        super().__init__(index, url, process)
        self.role, self.kv_port, self.name = role, kv_port, name


class RayPDWorker(_KVAddress, RayWorker):
    """A P/D worker placed by Ray (`ray_placement`): `PDProcess`'s role, name and KV address
    over a `RayWorker`; its KV receiver listens on its node's address, as its server does."""

    def __init__(self, worker: RayWorker, role: str, name: str) -> None:
        super().__init__(worker.index, worker.url, worker.node, worker.actor, worker.reported)
        self.role, self.name = role, name
        self.kv_port = worker.reported[1] if isinstance(worker.reported, tuple) else None


def start_pd_workers(
    config: ServerConfig,
    prefill: int,
    decode: int,
    *,
    log_level: str = "warning",
    startup_timeout_s: float = 600.0,
    park_timeout_s: float = 30.0,
    install_wait_s: float = 10.0,
    ray_address: str | None = None,
) -> list[PDProcess] | list[RayPDWorker]:
    """Start `prefill` prefill and `decode` decode workers (indices in that order) and return
    them once each answers /health; on any failure every one started is stopped. With
    `ray_address` they are Ray actors spread over that cluster (`ray_placement`)."""
    roles = ["prefill"] * prefill + ["decode"] * decode
    names = [f"prefill-{i}" for i in range(prefill)] + [f"decode-{i}" for i in range(decode)]
    servings = [
        functools.partial(
            _serve_role,
            role=role,
            name=names[index],
            park_timeout_s=park_timeout_s,
            install_wait_s=install_wait_s,
        )  # fmt: skip
        for index, role in enumerate(roles)
    ]
    if ray_address is not None:
        placed = start_ray_workers(
            config, len(servings), ray_address, log_level=log_level,
            startup_timeout_s=startup_timeout_s, servings=servings,
        )  # fmt: skip
        return [RayPDWorker(worker, roles[i], names[i]) for i, worker in enumerate(placed)]
    spawned = spawn_workers(
        config, servings, log_level=log_level, startup_timeout_s=startup_timeout_s
    )
    return [
        PDProcess(index, url, process, roles[index], kv_port, names[index])
        for index, (process, (url, kv_port)) in enumerate(spawned)
    ]


def stop_pd_workers(workers: list) -> None:
    """Stop what `start_pd_workers` started, here or on Ray."""
    if workers and isinstance(workers[0], RayWorker):
        stop_ray_workers(workers)
    else:
        stop_workers(workers)


def _serve_role(
    config: ServerConfig,
    stop: asyncio.Event,
    on_listening: Callable[[object], None],
    *,
    role: str,
    name: str,
    park_timeout_s: float,
    install_wait_s: float,
) -> Awaitable[None]:
    """A P/D worker's serving (`replicas.Serving`): reports (URL, KV receiver port)."""
    return serve_worker(
        config, role, name, stop=stop,
        on_listening=lambda url, kv_port: on_listening((url, kv_port)),
        park_timeout_s=park_timeout_s, install_wait_s=install_wait_s,
    )  # fmt: skip
