"""A fault plan applied to one run: the TCP proxy in front of the target, the client-fault
transport, engine faults on a managed server, and the scheduler that opens and closes each
window on time. The load loop knows none of this: it sends through the session, a transport
layer the CLI hands the run (`harness.run.extensions.RunExtensions`).

What an engine fault does to the server when its window opens and closes is registered in
one table, `ENGINE_FAULTS`; network windows become the proxy's toxics and client windows
transport wrappers (`faults.client.ClientFaults`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from faults.client import ClientFaults
from faults.cluster import (
    check_cluster_target,
    cluster_fault_off,
    cluster_fault_on,
    kv_link_toxic_off,
    kv_link_toxic_on,
    root_url,
)
from faults.plan import FaultPlan
from faults.proxy import FaultProxy
from faults.toxics import Toxic
from faults.window import FaultKind, Layer, Window, WindowTracker
from harness.errors import HarnessError
from harness.http.client import ClientOptions, RawResult, RequestPayload
from harness.http.transport import BaseTransport
from harness.targets.process import ServerProcess

POLL_S = 0.02  # how often windows are checked; their start and end are this accurate

# What an engine fault does to the server (in a worker thread: signals and HTTP calls block).
EngineAction = Callable[[ServerProcess, Window], Awaitable[None]]


async def _restart(server: ServerProcess, window: Window) -> None:
    delay_s = (window.param("restart_delay_ms") or 0) / 1e3
    await asyncio.to_thread(server.restart, delay_s)


async def _pause(server: ServerProcess, window: Window) -> None:
    server.pause()


async def _resume(server: ServerProcess, window: Window) -> None:
    server.resume()


async def _slow_steps(server: ServerProcess, window: Window) -> None:
    await asyncio.to_thread(server.set_step_delay, window.param("delay_ms"))


async def _normal_steps(server: ServerProcess, window: Window) -> None:
    await asyncio.to_thread(server.set_step_delay, 0)


@dataclass(frozen=True)
class EngineFault:
    """An engine fault kind: `start` when its window opens, `end` when it closes (None:
    nothing to undo). `outage`: the window lasts until `start` returned (a kill's outage
    ends when the restarted engine answers), not until its `for`. `undo_at_exit`: a window
    still open when the session closes is undone then (the server outlives the run)."""

    start: EngineAction
    end: EngineAction | None = None
    outage: bool = False
    undo_at_exit: bool = False


ENGINE_FAULTS: dict[FaultKind, EngineFault] = {
    FaultKind.KILL_ENGINE: EngineFault(_restart, outage=True),
    FaultKind.PAUSE_ENGINE: EngineFault(_pause, _resume),
    FaultKind.SLOW_STEPS: EngineFault(_slow_steps, _normal_steps, undo_at_exit=True),
    FaultKind.KILL_DECODE_WORKER: EngineFault(cluster_fault_on),
    FaultKind.KILL_PREFILL_WORKER: EngineFault(cluster_fault_on),
    FaultKind.CORRUPT_KV: EngineFault(cluster_fault_on, cluster_fault_off, undo_at_exit=True),
    FaultKind.CUT_KV_LINK: EngineFault(cluster_fault_on, cluster_fault_off, undo_at_exit=True),
    FaultKind.KV_LINK_LATENCY: EngineFault(kv_link_toxic_on, kv_link_toxic_off, undo_at_exit=True),
    FaultKind.KV_LINK_BANDWIDTH: EngineFault(
        kv_link_toxic_on, kv_link_toxic_off, undo_at_exit=True
    ),
}


class FaultSession(BaseTransport):
    """Use as `async with FaultSession(plan, options, server=..., max_connections=n) as s:`,
    send through `s` (a transport), call `s.start(t0_ns)` when the measured phase starts,
    and record `s.manifest_changes()` once it closed (each window's kind and actual start
    and end, seconds from t0). `aclose` closes it as leaving the `with` block does."""

    def __init__(
        self,
        plan: FaultPlan,
        options: ClientOptions,
        *,
        server: ServerProcess | None,
        max_connections: int,
    ) -> None:
        if plan.needs_managed_engine and server is None:
            raise HarnessError(
                f"the fault plan {plan.name!r} acts on the engine process, which only a managed "
                "target has; run it without --url (the reference engine is then started for it)."
            )
        self.plan = plan
        self.server = server
        self.options = options
        self.proxy: FaultProxy | None = None
        self.max_connections = max_connections
        self.client: ClientFaults | None = None
        self.applied: list[dict] = []
        self._t0_ns: int | None = None
        self._task: asyncio.Task | None = None
        self._open: dict[int, dict] = {}
        self._started: set[int] = set()
        self._engine_jobs: list[asyncio.Task] = []
        self._closed = False

    async def __aenter__(self) -> FaultSession:
        try:
            if self.server is not None:
                kinds = set(self.plan.kinds_by_layer.get(Layer.ENGINE, ()))
                await asyncio.to_thread(check_cluster_target, root_url(self.server), kinds)
            if self.plan.needs_proxy:
                url = urllib.parse.urlsplit(self.options.base_url)
                proxy = FaultProxy(url.hostname, url.port or 80, seed=self.plan.seed)
                await proxy.start()
                self.proxy = proxy
                proxied = url._replace(netloc=f"127.0.0.1:{proxy.url_port}").geturl()
                self.options = dataclasses.replace(self.options, base_url=proxied)
            self.client = ClientFaults(
                self.plan, self.options, max_connections=self.max_connections
            )
            await self.client.__aenter__()
            await self._open_engine_windows_at_zero()
        except BaseException:
            await self.aclose()  # what opened before the failure (proxy, client) closes again
            raise
        return self

    async def _open_engine_windows_at_zero(self) -> None:
        """Apply the engine faults of windows open from the start before any request is sent
        (warm-up included): applied by the scheduler after t0, a fast engine ran a run's
        first steps before the fault's HTTP call reached it."""
        active = WindowTracker(self.plan).poll(0.0, 0)
        for i, w in enumerate(self.plan.windows):
            if w not in active or w.layer is not Layer.ENGINE:
                continue
            entry = {"kind": w.kind.value, "layer": w.layer.value, "start_s": 0.0}
            self._started.add(i)
            self._open[i] = entry
            self.applied.append(entry)
            await self._engine_fault(w, entry, start=True)

    async def aclose(self) -> None:
        """Stop the windows' clock, close the windows still open (undoing the engine faults
        the server would keep), then the client stack and the proxy; a second call does
        nothing."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for job in self._engine_jobs:
            with contextlib.suppress(Exception):
                await job
        now_s = self._elapsed_s()
        for entry in self._open.values():
            entry.setdefault("end_s", now_s)
        still_open = [self.plan.windows[i] for i in sorted(self._open)]
        self._open.clear()
        if self.server is not None:
            self.server.resume()
            await self._undo_at_exit(still_open)
        try:
            if self.client is not None:
                await self.client.aclose()
        finally:
            if self.proxy is not None:
                await self.proxy.stop()

    async def _undo_at_exit(self, still_open: list[Window]) -> None:
        """Undo, once per kind, the engine faults whose windows were still open and that the
        server would otherwise keep after the run (a slowed engine stays slow)."""
        undone: set[FaultKind] = set()
        for window in still_open:
            fault = ENGINE_FAULTS.get(window.kind)
            if fault is None or not fault.undo_at_exit or window.kind in undone:
                continue
            undone.add(window.kind)
            with contextlib.suppress(HarnessError):
                await fault.end(self.server, window)

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        await self.client.handle_request(payload, result)

    def start(self, t0_ns: int) -> None:
        """The measured phase began at `t0_ns`: start the windows' clock."""
        self._t0_ns = t0_ns
        self.client.clock.start(t0_ns)
        self._task = asyncio.get_running_loop().create_task(self._schedule())

    def _elapsed_s(self) -> float:
        return 0.0 if self._t0_ns is None else (time.perf_counter_ns() - self._t0_ns) / 1e9

    async def _schedule(self) -> None:
        tracker = WindowTracker(self.plan)
        toxics: tuple = ()
        while True:
            elapsed = self._elapsed_s()
            active = tracker.poll(elapsed, self.client.clock.requests_sent)
            now = {i for i, w in enumerate(self.plan.windows) if w in active}
            for i in sorted(now - self._started):
                w = self.plan.windows[i]
                entry = {"kind": w.kind.value, "layer": w.layer.value, "start_s": elapsed}
                self._started.add(i)
                self._open[i] = entry
                self.applied.append(entry)
                if w.layer is Layer.ENGINE:
                    job = self._engine_fault(w, entry, start=True)
                    self._engine_jobs.append(asyncio.create_task(job))
            for i in sorted(set(self._open) - now):
                entry = self._open.pop(i)
                entry.setdefault("end_s", elapsed)
                w = self.plan.windows[i]
                if w.layer is Layer.ENGINE:
                    job = self._engine_fault(w, entry, start=False)
                    self._engine_jobs.append(asyncio.create_task(job))
            if self.proxy is not None:
                wanted = tuple(
                    Toxic(
                        kind=w.kind.value,
                        direction=(w.direction.value if w.direction else "downstream"),
                        fraction=w.fraction,
                        params=dict(w.params),
                    )
                    for w in active
                    if w.layer is Layer.NETWORK
                )
                if wanted != toxics:
                    self.proxy.set_toxics(wanted)
                    toxics = wanted
            await asyncio.sleep(POLL_S)

    async def _engine_fault(self, window: Window, entry: dict, *, start: bool) -> None:
        """Apply (or, at the window's end, undo) an engine fault of `ENGINE_FAULTS`; what
        went wrong is kept in the window's manifest entry as `error`, since the run goes on."""
        fault = ENGINE_FAULTS[window.kind]
        action = fault.start if start else fault.end
        if action is None:
            return
        try:
            await action(self.server, window)
        except HarnessError as exc:
            entry["error"] = str(exc)
            return
        if start and fault.outage:
            # The outage lasts from the fault until the engine answers again.
            entry["end_s"] = self._elapsed_s()

    def manifest_entry(self) -> dict:
        """The `fault_plan` section of the manifest: the plan, its hash, the windows applied."""
        entry = {
            "name": self.plan.name,
            "sha256": self.plan.sha256,
            "plan": self.plan.to_dict(),
            "windows": [dict(w) for w in self.applied],
        }
        if self.client is not None and self.client.attempts:
            entry["retries"] = {
                rid: [dataclasses.asdict(a) for a in attempts]
                for rid, attempts in self.client.attempts.items()
            }
        if self.server is not None:
            entry["engine_restarts"] = self.server.restarts
        if self.proxy is not None:
            entry["proxy"] = self.proxy.stats
        return entry

    def manifest_changes(self) -> dict:
        """What the run records in its manifest: the `fault_plan` section."""
        return {"fault_plan": self.manifest_entry()}
