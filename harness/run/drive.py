"""Drive a planned run: the load phase in this process (through the aiohttp transport, a test
transport or an extension's transport layer), in worker processes or in Ray actors, with the
progress display and the saturation watch observing it."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from harness.http.client import AiohttpTransport
from harness.http.transport import Transport
from harness.load.loadgen import run_load
from harness.load.pool import drive_workers
from harness.load.progress import ProgressDisplay
from harness.load.ray_workers import drive_ray, ray_split
from harness.load.saturation_watch import Observers, SaturationWatch
from harness.load.services import run_services, stop_reason_of
from harness.load.split import (
    WorkerSplit,
    check_workers_supported,
    connection_pool_size,
    split_for,
)
from harness.run.context import RunContext
from harness.run.extensions import TransportLayerFactory


@dataclass(frozen=True)
class Driven:
    """How the load phase ended: why it stopped early (None: it did not) and, for workers
    or Ray actors, their manifest entries."""

    reason: str | None
    workers: list[dict] | None = None


def worker_split(run: RunContext, transport: Transport | None) -> WorkerSplit | None:
    """The split of the plan for `--workers`/`--ray`, or None for one process."""
    load = run.config.load
    if not load.is_split:
        return None
    check_workers_supported(transport)
    if load.ray_address is not None:
        return ray_split(run.plan, run.options, workers=load.workers, address=load.ray_address)
    return split_for(run.plan, run.options, workers=load.workers)


def drive(
    run: RunContext,
    split: WorkerSplit | None,
    *,
    transport: Transport | None = None,
    layer: TransportLayerFactory | None = None,
) -> Driven:
    """Run the load phase to its end, a stop or a signal (each on its own event loop)."""
    display, observer = observers(run, len(run.plan.payloads))
    stop_on_loss = run.config.stop.on_worker_failure == "stop"

    def on_lost(_index: int, sentence: str) -> None:
        run.warn(sentence)

    if split is None:
        return Driven(asyncio.run(drive_here(run, display, observer, transport, layer)))
    if split.mode == "ray":
        reason, entries = asyncio.run(
            drive_ray(run, split, on_lost=on_lost, stop_on_loss=stop_on_loss)
        )
    else:
        reason, entries = asyncio.run(
            drive_workers(
                run,
                split.shares,
                observer=observer,
                display=display,
                on_lost=on_lost,
                stop_on_loss=stop_on_loss,
            )
        )
    return Driven(reason, entries)


def observers(run: RunContext, total: int):
    """The progress display (unless quiet) and one observer of the load: the display, the
    saturation watch (`--stop-on-saturation`) and the run's own count of requests in flight."""
    display = (
        ProgressDisplay(total, run.console) if (not run.quiet and run.console is not None) else None
    )
    watch = SaturationWatch(run.request_stop) if run.config.stop.stop_on_saturation else None
    return display, Observers(display, watch, run)


async def drive_here(
    run: RunContext,
    display: ProgressDisplay | None,
    observer,
    transport: Transport | None,
    layer: TransportLayerFactory | None,
) -> str | None:
    """The load loop in this process, with signal handling and periodic flushes; returns why
    it stopped early (None: it did not).

    Requests go through `layer(...)` when an extension gives one (it is told when the
    measured phase starts, and its manifest sections are recorded once it closed), else
    `transport` (a test double), else the aiohttp transport; whichever it is, it is entered
    for the load phase and closed after it."""
    plan = run.plan
    max_connections = connection_pool_size(plan)
    signalled: dict = {}
    try:
        async with run_services(run) as signalled, contextlib.AsyncExitStack() as stack:
            start = run.start
            if layer is not None:
                layered = layer(run.options, run.server, max_connections)
                # Registered first, so it runs last: after the layer closed what it opened.
                stack.callback(lambda: run.record_in_manifest(**layered.manifest_changes()))
                transport = await stack.enter_async_context(layered)

                def start(t0_ns: int) -> None:
                    run.start(t0_ns)
                    layered.start(t0_ns)

            else:
                transport = transport or AiohttpTransport(
                    run.options, max_connections=max_connections
                )
                transport = await stack.enter_async_context(transport)
            with display or contextlib.nullcontext():
                await run_load(transport, plan, run.on_result, observer, start_callback=start)
    except asyncio.CancelledError:
        return stop_reason_of(run, signalled)
    return None
