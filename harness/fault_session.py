"""A fault plan applied to one run: the TCP proxy in front of the target, the client-fault
transport, engine faults on a managed server, and the scheduler that opens and closes each
window on time. The load loop knows none of this: it sends through the session's transport."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import urllib.parse

from harness.errors import HarnessError
from harness.http.client import ClientOptions, RawResult, RequestPayload
from harness.targets.process import ServerProcess

POLL_S = 0.02  # how often windows are checked; their start and end are this accurate


class FaultSession:
    """Use as `async with FaultSession(plan, options, server=..., max_connections=n) as s:`,
    send through `s` (it is a Transport), pass `s.start` as the measured phase's start callback,
    and read `s.applied` (each window's kind and actual start and end, seconds from t0)."""

    def __init__(
        self,
        plan,
        options: ClientOptions,
        *,
        server: ServerProcess | None,
        max_connections: int,
    ) -> None:
        from faults.client import ClientFaults

        if plan.needs_managed_engine and server is None:
            raise HarnessError(
                f"the fault plan {plan.name!r} acts on the engine process, which only a managed "
                "target has; run it without --url (the reference engine is then started for it)."
            )
        self.plan = plan
        self.server = server
        self.options = options
        self.proxy = None
        self.max_connections = max_connections
        self.client: ClientFaults | None = None
        self.applied: list[dict] = []
        self._t0_ns: int | None = None
        self._task: asyncio.Task | None = None
        self._open: dict[int, dict] = {}
        self._started: set[int] = set()
        self._engine_jobs: list[asyncio.Task] = []

    async def __aenter__(self) -> FaultSession:
        from faults.client import ClientFaults
        from faults.proxy import FaultProxy

        if self.plan.needs_proxy:
            url = urllib.parse.urlsplit(self.options.base_url)
            self.proxy = FaultProxy(url.hostname, url.port or 80, seed=self.plan.seed)
            await self.proxy.start()
            proxied = url._replace(netloc=f"127.0.0.1:{self.proxy.url_port}").geturl()
            self.options = dataclasses.replace(self.options, base_url=proxied)
        self.client = ClientFaults(self.plan, self.options, max_connections=self.max_connections)
        await self.client.__aenter__()
        await self._open_engine_windows_at_zero()
        return self

    async def _open_engine_windows_at_zero(self) -> None:
        """Apply the engine faults of windows open from the start before any request is sent
        (warm-up included): applied by the scheduler after t0, a fast engine ran a run's
        first steps before the fault's HTTP call reached it."""
        from faults.plan import Layer, WindowTracker

        active = WindowTracker(self.plan).poll(0.0, 0)
        for i, w in enumerate(self.plan.windows):
            if w not in active or w.layer is not Layer.ENGINE:
                continue
            entry = {"kind": w.kind.value, "layer": w.layer.value, "start_s": 0.0}
            self._started.add(i)
            self._open[i] = entry
            self.applied.append(entry)
            await self._engine_fault(w, entry, start=True)

    async def __aexit__(self, *exc_info) -> None:
        from faults.plan import FaultKind

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
        still_slow = any(self.plan.windows[i].kind is FaultKind.SLOW_STEPS for i in self._open)
        self._open.clear()
        if self.server is not None:
            self.server.resume()
            if still_slow:
                with contextlib.suppress(HarnessError):
                    await asyncio.to_thread(self.server.set_step_delay, 0)
        try:
            if self.client is not None:
                await self.client.__aexit__(*exc_info)
        finally:
            if self.proxy is not None:
                await self.proxy.stop()

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
        from faults.plan import Layer, WindowTracker
        from faults.toxics import Toxic

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

    async def _engine_fault(self, window, entry: dict, *, start: bool) -> None:
        """Apply (or, at the window's end, undo) an engine fault; what went wrong is kept in
        the window's manifest entry as `error`, since the run goes on."""
        try:
            await self._apply_engine_fault(window, entry, start=start)
        except HarnessError as exc:
            entry["error"] = str(exc)

    async def _apply_engine_fault(self, window, entry: dict, *, start: bool) -> None:
        from faults.plan import FaultKind

        server = self.server
        if window.kind is FaultKind.KILL_ENGINE and start:
            await asyncio.to_thread(server.kill)
            await asyncio.sleep((window.param("restart_delay_ms") or 0) / 1e3)
            await asyncio.to_thread(server.start)
            server.restarts += 1
            # The outage lasts from the kill until the restarted engine answers /health.
            entry["end_s"] = self._elapsed_s()
        elif window.kind is FaultKind.PAUSE_ENGINE:
            (server.pause if start else server.resume)()
        elif window.kind is FaultKind.SLOW_STEPS:
            delay_ms = window.param("delay_ms") if start else 0
            await asyncio.to_thread(server.set_step_delay, delay_ms)

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
