"""`bench run --ray ADDRESS`: the worker shares of `harness.load.split` run as Ray actors, spread
across a cluster's nodes (Ray is an optional extra: `pip install 'llm-bench-harness[ray]'`).

Each actor measures latencies with its own node's monotonic clock. At start the parent measures
every actor's clock offset with a few round trips and keeps the sample with the smallest round
trip (offset = remote - (send + receive) / 2, uncertainty = round trip / 2); the actor is given
the shared start time on its own clock, and its results, which come back through Ray's object
store when it is done, are shifted onto the parent's timeline. The offsets and their
uncertainty go into the manifest (`workers.per_worker`) and onto the card.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from harness.errors import HarnessError
from harness.http.client import ClientOptions, RawResult
from harness.load.loadgen import LoadPlan
from harness.load.pool import drive_share
from harness.load.services import DrivenRun, run_services, stop_reason_of
from harness.load.split import WorkerShare, WorkerSplit, split_into
from slo.runrecord import ErrorClass, RequestStatus

INSTALL_SENTENCE = (
    "--ray needs Ray, which is not installed here; install the extra with "
    "pip install 'llm-bench-harness[ray]'."
)
RAY_CLOCK = (
    "per-node CLOCK_MONOTONIC: each actor's offset to the parent's clock was measured at start "
    "from the smallest of a few round trips (offset = remote - (send + receive) / 2, "
    "uncertainty = round trip / 2) and its times were shifted onto the parent's timeline"
)
OFFSET_SAMPLES = 7
START_LEAD_NS = 200_000_000  # the shared start time is this far after the last offset sample


def require_ray():
    """The `ray` module; a `HarnessError` naming the extra when it is not installed."""
    try:
        import ray
    except ImportError:
        raise HarnessError(INSTALL_SENTENCE) from None
    return ray


def connect(address: str) -> int:
    """Join (or, for `local`, start) the Ray cluster at `address`; the number of alive nodes."""
    ray = require_ray()
    if not ray.is_initialized():
        try:
            ray.init(
                address=address,
                log_to_driver=False,
                logging_level=logging.WARNING,
                include_dashboard=False if address == "local" else None,
            )
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise HarnessError(
                f"cannot reach the Ray cluster at {address!r} ({exc}); start one with "
                "ray start --head, or use --ray local."
            ) from None
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def ray_split(
    plan: LoadPlan, options: ClientOptions, *, workers: int | str | None, address: str
) -> WorkerSplit:
    """The `WorkerSplit` of `--ray ADDRESS`: `workers` actors (a count), or one per alive node
    of the cluster (None or `auto`)."""
    nodes = connect(address)
    if workers in (None, "auto"):
        wanted, why = nodes, f"one Ray actor per alive node: {nodes}"
    else:
        wanted, why = int(workers), f"--workers {workers}"
    return split_into(
        plan, options, wanted, requested=workers, why=why, mode="ray", clock=RAY_CLOCK
    )


def clock_offset(samples: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
    """(offset_ns, uncertainty_ns) of a remote clock from (t_send, t_remote, t_receive)
    samples (local, remote, local ns): the sample with the smallest round trip decides;
    offset = t_remote - midpoint, and the true offset lies within +/- uncertainty
    (half that round trip, rounded up) when the remote read fell inside the round trip."""
    if not samples:
        raise ValueError("clock_offset needs at least one sample")
    t_send, t_remote, t_recv = min(samples, key=lambda s: s[2] - s[0])
    return t_remote - (t_send + t_recv) // 2, -(-(t_recv - t_send) // 2)


def shift_raw(raw: RawResult, delta_ns: int) -> RawResult:
    """`raw` with every time moved by `delta_ns` (onto another clock); None stays None."""

    def moved(t_ns: int | None) -> int | None:
        return None if t_ns is None else t_ns + delta_ns

    raw.t_scheduled_ns = moved(raw.t_scheduled_ns)
    raw.t_sent_ns = moved(raw.t_sent_ns)
    raw.t_first_byte_ns = moved(raw.t_first_byte_ns)
    raw.t_done_ns = moved(raw.t_done_ns)
    raw.reads = [(t + delta_ns, data) for t, data in raw.reads]
    return raw


class BenchWorkerActor:
    """One worker share as a Ray actor (async: `go` and `stop` arrive while `run` runs)."""

    def __init__(self) -> None:
        self._ready = asyncio.Event()
        self._go: asyncio.Future | None = None
        self._task: asyncio.Task | None = None

    async def clock_ns(self) -> int:
        return time.perf_counter_ns()

    async def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def wait_ready(self) -> None:
        await self._ready.wait()

    async def go(self, t0_local_ns: int) -> None:
        if self._go is not None and not self._go.done():
            self._go.set_result(t0_local_ns)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._ready.set()

    async def run(self, share: WorkerShare) -> list[RawResult]:
        results: list[RawResult] = []
        self._go = asyncio.get_running_loop().create_future()

        async def start_gate() -> int:
            self._ready.set()
            return await self._go

        self._task = asyncio.create_task(
            drive_share(share, start_gate=start_gate, on_result=results.append)
        )
        try:
            await self._task
        except asyncio.CancelledError:
            pass  # stopped: run_load has handed every request over (cancelled / not_sent)
        return results


async def _offset(actor) -> tuple[int, int]:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(OFFSET_SAMPLES):
        t_send = clock()
        t_remote = await actor.clock_ns.remote()
        samples.append((t_send, t_remote, clock()))
    return clock_offset(samples)


def _lost(share: WorkerShare, sentence: str) -> list[RawResult]:
    """A dead actor's requests: its results never came back, so whether each was sent is not
    known; all are `unknown` (`worker_lost`)."""
    warmup = {p.request_id for p in share.plan.warmup}
    out = []
    for rid in share.request_ids:
        raw = RawResult(rid, rid in warmup, None)
        raw.status = RequestStatus.UNKNOWN
        raw.error_class = ErrorClass.WORKER_LOST
        raw.error_message = f"{sentence}; its results were lost"
        out.append(raw)
    return out


async def drive_ray(
    run: DrivenRun,
    split: WorkerSplit,
    *,
    on_lost: Callable[[int, str], None],
    stop_on_loss: bool,
) -> tuple[str | None, list[dict]]:
    """`harness.load.pool.drive_workers` for `--ray`: run `split`'s shares as actors, record
    their results through `run` on the parent's timeline. Returns (why the run stopped early,
    or None; the manifest's per-worker entries)."""
    ray = require_ray()
    actor_class = ray.remote(num_cpus=1)(BenchWorkerActor)
    actors = [actor_class.options(scheduling_strategy="SPREAD").remote() for _ in split.shares]
    entries = [
        {"worker": s.index, "requests": len(s.plan.payloads), "warmup": len(s.plan.warmup)}
        for s in split.shares
    ]
    lost: list[str] = []

    def lose(index: int, sentence: str) -> None:
        lost.append(sentence)
        on_lost(index, sentence)
        if stop_on_loss:
            run.request_stop(f"{sentence}; the other actors were stopped")

    signalled: dict = {}
    reason = None
    runs = []
    try:
        async with run_services(run) as signalled:
            runs = [a.run.remote(s) for a, s in zip(actors, split.shares, strict=True)]
            try:
                await asyncio.gather(*(a.wait_ready.remote() for a in actors))
                for entry, actor in zip(entries, actors, strict=True):
                    entry["node"] = await actor.node_id.remote()
                    entry["clock_offset_ns"], entry["clock_uncertainty_ns"] = await _offset(actor)
                t0_ns = time.perf_counter_ns() + START_LEAD_NS
                run.start(t0_ns)
                await asyncio.gather(
                    *(
                        a.go.remote(t0_ns + e["clock_offset_ns"])
                        for a, e in zip(actors, entries, strict=True)
                    )
                )
                await _collect(run, split, runs, entries, lose)
            except asyncio.CancelledError:
                for actor in actors:
                    actor.stop.remote()
                await _collect(run, split, runs, entries, lose)
                raise
    except asyncio.CancelledError:
        reason = stop_reason_of(run, signalled)
    finally:
        for actor in actors:
            ray.kill(actor)
        ray.shutdown()
    if reason is None and lost:
        reason = (
            f"{'; '.join(lost)} mid-run: its requests are unknown; the other actors ran to "
            "the end (--on-worker-failure continue)"
        )
    return reason, [{k: v for k, v in e.items() if k != "collected"} for e in entries]


async def _collect(run: DrivenRun, split: WorkerSplit, runs, entries, lose) -> None:
    """Take every actor's results as it finishes (shifted onto the parent's clock); a dead
    actor's requests are recorded lost and `lose(index, sentence)` is told."""
    ray = require_ray()
    pending = {ref: k for k, ref in enumerate(runs) if not entries[k].get("collected")}

    async def one(ref, k):
        share, entry = split.shares[k], entries[k]
        try:
            raws = await ref
        except ray.exceptions.RayError as exc:
            entry["collected"] = True
            sentence = f"Ray actor {k} on node {entry.get('node')} died ({type(exc).__name__})"
            entry["died"] = True
            for raw in _lost(share, sentence):
                run.on_result(raw)
            lose(k, sentence)
            return
        entry["collected"], entry["died"] = True, False
        offset = entry.get("clock_offset_ns", 0)
        for raw in raws:
            run.on_result(shift_raw(raw, -offset))

    await asyncio.gather(*(one(ref, k) for ref, k in pending.items()))
