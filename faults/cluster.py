"""Cluster faults of a fault plan (`kill_decode_worker`, `kill_prefill_worker`, `corrupt_kv`,
`cut_kv_link`) on a managed P/D cluster: each is one call to the router's
`POST /admin/cluster_fault` (`engine_ref.cluster.cluster_faults`), on when its window opens
and off when it closes (a kill is instantaneous: nothing to undo). `worker` counts the
cluster's workers as its /metrics' `worker` label does (prefill workers first).

`kv_link_latency` and `kv_link_bandwidth` are the TCP fault proxy's own toxics on the KV link:
for the window, a `FaultProxy` stands in front of each decode worker's KV port (or the one
named), the router is told to send that worker's handoffs through it (`kv_link_via`), and the
toxic acts on the data toward the decode worker; at the window's end the router sends straight
again and the proxy stops once the handoffs already going through it ended.

A plan using them against a target that is not a P/D cluster is refused before the run, in
one sentence, from the target's `/info` (its `cluster.pd` block): against a single engine the
faults would have nothing to act on and the run would measure no fault at all.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from faults.proxy import FaultProxy
from faults.toxics import Toxic
from faults.window import CLUSTER_KINDS, FaultKind, Window
from harness.errors import HarnessError
from harness.targets.process import ServerProcess

__all__ = [
    "check_cluster_target",
    "cluster_fault_off",
    "cluster_fault_on",
    "kv_link_toxic_off",
    "kv_link_toxic_on",
    "root_url",
]

_TIMEOUT_S = 10.0
_DRAIN_S = 10.0


def _post(base_url: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{base_url}/admin/cluster_fault",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            detail = exc.read().decode("utf-8", "replace")[:300]
        raise HarnessError(
            f"the cluster's router refused the {body['kind']} fault ({exc.code}): {detail}"
        ) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise HarnessError(
            f"the cluster's router did not take the {body['kind']} fault: {exc}."
        ) from None


def root_url(server: ServerProcess) -> str:
    return f"http://127.0.0.1:{server.port}"


def _body(window: Window, on: bool) -> dict:
    body: dict = {"kind": window.kind.value, "on": on}
    if window.param("worker") is not None:
        body["worker"] = int(window.param("worker"))
    return body


async def cluster_fault_on(server: ServerProcess, window: Window) -> None:
    await asyncio.to_thread(_post, root_url(server), _body(window, True))


async def cluster_fault_off(server: ServerProcess, window: Window) -> None:
    await asyncio.to_thread(_post, root_url(server), _body(window, False))


# The proxies each open kv_link window put in front of decode workers (by id of the window).
_LINK_PROXIES: dict[int, list[tuple[int, FaultProxy]]] = {}
_TOXIC_KIND = {FaultKind.KV_LINK_LATENCY: "latency", FaultKind.KV_LINK_BANDWIDTH: "bandwidth"}


def _info(base_url: str) -> dict:
    try:
        with urllib.request.urlopen(f"{base_url}/info", timeout=_TIMEOUT_S) as resp:
            info = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _decode_kv_ports(info: dict) -> list[tuple[int, int]]:
    """(cluster index, KV port) of each decode worker, from /info's `cluster.pd`."""
    pd = info["cluster"]["pd"]
    first = len(pd["prefill_workers"])
    return [(first + i, int(d["kv_port"])) for i, d in enumerate(pd["decode_workers"])]


async def kv_link_toxic_on(server: ServerProcess, window: Window) -> None:
    base = root_url(server)
    ports = _decode_kv_ports(await asyncio.to_thread(_info, base))
    wanted = window.param("worker")
    chosen = [(i, port) for i, port in ports if wanted is None or i == wanted]
    if not chosen:
        raise HarnessError(
            f"the {window.kind} window names worker {wanted}, which is not a decode worker of "
            f"the cluster (decode workers: {', '.join(str(i) for i, _ in ports)})."
        )
    params = {k: v for k, v in window.params if k != "worker"}
    toxic = Toxic(kind=_TOXIC_KIND[window.kind], direction="upstream", params=params)
    proxies = _LINK_PROXIES.setdefault(id(window), [])
    for index, kv_port in chosen:
        proxy = FaultProxy("127.0.0.1", kv_port)
        await proxy.start()
        proxy.set_toxics((toxic,))
        proxies.append((index, proxy))
        body = {"kind": "kv_link_via", "on": True, "worker": index, "host": "127.0.0.1",
                "port": proxy.url_port}  # fmt: skip
        await asyncio.to_thread(_post, base, body)


async def kv_link_toxic_off(server: ServerProcess, window: Window) -> None:
    base = root_url(server)
    try:
        for index, _ in _LINK_PROXIES.get(id(window), []):
            body = {"kind": "kv_link_via", "on": False, "worker": index}
            await asyncio.to_thread(_post, base, body)
    finally:
        for _, proxy in _LINK_PROXIES.pop(id(window), []):
            await _drained(proxy)
            await proxy.stop()


async def _drained(proxy: FaultProxy) -> None:
    """Wait (up to `_DRAIN_S`) for the handoffs already under way through `proxy` to end: the
    window's end stops new ones going through it, it does not cut the ones it delayed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _DRAIN_S
    while proxy.stats["open"] and loop.time() < deadline:
        await asyncio.sleep(0.02)


def check_cluster_target(base_url: str, kinds: set[FaultKind]) -> None:
    """Raise HarnessError (one sentence) unless `base_url`'s /info has a P/D `cluster` block,
    when `kinds` has a cluster kind."""
    used = sorted(k.value for k in kinds & CLUSTER_KINDS)
    if not used:
        return
    cluster = _info(base_url).get("cluster")
    if not isinstance(cluster, dict) or not cluster.get("pd"):
        raise HarnessError(
            f"the fault plan's {', '.join(used)} acts on a P/D cluster's workers and KV link, "
            "but the target is not one (its /info has no cluster.pd block); start it with "
            "--server-arg=--prefill-workers=N --server-arg=--decode-workers=M."
        )
