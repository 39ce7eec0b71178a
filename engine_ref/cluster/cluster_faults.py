"""Fault injection in a cluster (`--enable-fault-injection`): the router's
`POST /admin/cluster_fault`, through which a fault plan (`faults.cluster`) kills a worker or
breaks the P/D KV link, so the router's failure paths (retry by recompute, an explicit 502)
run on demand rather than when a real link happens to fail.

The body is `{"kind": K, "on": true|false, "worker": i}`:
- `kill_decode_worker` / `kill_prefill_worker`: SIGKILL that role's worker process (worker `i`
  by its index in the cluster, else the first live one of the role); instantaneous, `on` is
  ignored. The router notices the exit as it notices any (`replicas.LocalWorker.watch`).
- `corrupt_kv`: while on, every handoff is sent with one bit of its first block flipped (the
  prefill worker's own `flip_bit` fault), so the decode worker's checksum refuses it.
- `cut_kv_link`: while on, every handoff goes through a cutter in the router that passes the
  first `CUT_AFTER_BYTES` bytes on to the decode worker's KV receiver, then closes both ends:
  the sender sees the link cut, the receiver a transfer that ended mid-way.
- `kv_link_via`: send decode worker `i`'s handoffs to `host`:`port` (a fault proxy in front of
  its KV port) while on; off: straight to the worker again.

Only the P/D router has a KV link and roles: a replicas router refuses every kind in one
sentence (409). The faults act on the next transfer to start; one under way is not touched.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web

from engine_ref.serving.errors import ApiError
from engine_ref.serving.middlewares import json_response
from engine_ref.serving.requests import decode_json_body

__all__ = ["CUT_AFTER_BYTES", "KINDS", "LinkFaults", "add_cluster_fault_route"]

KINDS = ("kill_decode_worker", "kill_prefill_worker", "corrupt_kv", "cut_kv_link", "kv_link_via")
_KILL_WAIT_S = 5.0
CUT_AFTER_BYTES = 256  # inside the handoff's header and first block for any model


class LinkFaults:
    """What the KV link does to the next handoffs: `kv_params` rewrites a prefill leg's
    `kv_transfer_params` (the one hook in `pd._Legs.run`)."""

    def __init__(self) -> None:
        self.corrupt = False
        self.cut = False
        self.via: dict[int, tuple[str, int]] = {}  # decode worker index -> where its KV goes
        self.cutters: dict[int, tuple[asyncio.AbstractServer, int]] = {}
        self.cut_connections = 0

    def kv_params(self, decode: Any, kv: dict) -> dict:
        """`kv` for a handoff to `decode` with the faults that are on."""
        kv = dict(kv)
        if self.corrupt:
            kv["fault"] = "flip_bit"
        if self.cut and decode.index in self.cutters:
            kv["decode_kv"] = f"127.0.0.1:{self.cutters[decode.index][1]}"
        elif decode.index in self.via:
            host, port = self.via[decode.index]
            kv["decode_kv"] = f"{host}:{port}"
        return kv

    async def start_cutters(self, decode_workers: list) -> None:
        for worker in decode_workers:
            if worker.index not in self.cutters and worker.kv_port is not None:
                handler = _cutter(self, worker.kv_host, worker.kv_port)
                server = await asyncio.start_server(handler, "127.0.0.1", 0)
                self.cutters[worker.index] = (server, server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        for server, _ in self.cutters.values():
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self.cutters.clear()


def _cutter(faults: LinkFaults, kv_host: str, kv_port: int):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        faults.cut_connections += 1
        upstream = None
        try:
            _, upstream = await asyncio.open_connection(kv_host, kv_port)
            passed = 0
            while passed < CUT_AFTER_BYTES:
                data = await reader.read(CUT_AFTER_BYTES - passed)
                if not data:
                    break
                upstream.write(data)
                await upstream.drain()
                passed += len(data)
        except OSError:
            pass
        finally:  # the cut: both ends closed without a reply
            for w in (writer, upstream):
                if w is not None:
                    w.transport.abort()

    return handle


def add_cluster_fault_route(app: web.Application, cluster: Any) -> None:
    """Serve `POST /admin/cluster_fault` for `cluster` (a `router.Cluster`); a P/D cluster's
    routing gets its `link_faults`."""
    if cluster.pd is not None and getattr(cluster.pd, "link_faults", None) is None:
        cluster.pd.link_faults = LinkFaults()

    async def cluster_fault(request: web.Request) -> web.Response:
        try:
            body = decode_json_body(await request.read())
            answer = await _apply(cluster, body)
        except ApiError as error:
            return json_response(error.body(), status=error.status)
        return json_response(answer)

    async def close_cutters(app: web.Application) -> None:
        faults = getattr(cluster.pd, "link_faults", None)
        if faults is not None:
            await faults.close()

    app.router.add_post("/admin/cluster_fault", cluster_fault)
    app.on_cleanup.append(close_cutters)


def _worker_index(body: dict, name: str = "worker") -> int | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ApiError(400, f"{name} must be a worker index (an integer).", param=name)
    return value


async def _apply(cluster: Any, body: dict) -> dict:
    kind = body.get("kind")
    if kind not in KINDS:
        raise ApiError(400, f"kind must be one of {', '.join(KINDS)}; got {kind!r}.", param="kind")
    routing = cluster.pd
    if routing is None:
        raise ApiError(409, f"{kind} needs a P/D cluster; this router serves replicas.")
    on = body.get("on", True)
    if not isinstance(on, bool):
        raise ApiError(400, "on must be true or false.", param="on")
    index = _worker_index(body)
    faults: LinkFaults = routing.link_faults
    if kind.startswith("kill_"):
        pool = routing.decode if kind == "kill_decode_worker" else routing.prefill
        live = [w for w in pool if w.alive and (index is None or w.index == index)]
        if not live:
            which = "" if index is None else f" {index}"
            raise ApiError(409, f"No live {pool[0].role} worker{which} to kill.")
        victim = live[0]
        victim.kill()  # its process (here, or on its Ray node)
        # Reaped here, on the loop's thread, as the router's exit watch reaps (never both at
        # once from two threads: the loser would read a reaped process as running).
        deadline = asyncio.get_running_loop().time() + _KILL_WAIT_S
        while victim.alive and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        cluster.mark_down(victim)
        return {"kind": kind, "killed": victim.index}
    if kind == "corrupt_kv":
        faults.corrupt = on
    elif kind == "cut_kv_link":
        if on:
            await faults.start_cutters(routing.decode)
        faults.cut = on
    else:
        if index is None or index not in {w.index for w in routing.decode}:
            raise ApiError(400, "kv_link_via needs worker: a decode worker's index.")
        if on:
            host, port = body.get("host"), body.get("port")
            if not isinstance(host, str) or not isinstance(port, int):
                raise ApiError(400, "kv_link_via needs host (text) and port (an integer).")
            faults.via[index] = (host, port)
        else:
            faults.via.pop(index, None)
    return {"kind": kind, "on": on}
