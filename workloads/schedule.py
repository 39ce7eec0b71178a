"""When a workload's requests arrive: the spec's arrival process as the command line's
overrides change it, how many requests it is asked for, and for how long."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from bench_common import yaml_spec as ys
from workloads import arrivals as arr
from workloads.options import WorkloadOptions
from workloads.schema import WorkloadError

if TYPE_CHECKING:
    from workloads.spec import WorkloadSpec


@dataclass(frozen=True)
class Schedule:
    """The arrival `process` (None: a trace's own timestamps, divided by `speedup`, with
    Gaussian `jitter_s`), the request cap `num_requests` (None: the duration or the dataset
    decides), `duration_s` (None: no time limit), and `closed_count`, the requests of a
    closed loop, which has no times to count."""

    process: arr.ArrivalProcess | None
    num_requests: int | None
    duration_s: float | None
    closed_count: int
    speedup: float = 1.0
    jitter_s: float = 0.0

    def draw(self, rng: np.random.Generator) -> tuple[np.ndarray | None, int]:
        """Arrival offsets (None for a closed loop) and the number of requests, for a source
        without timestamps of its own."""
        if self.process is None:
            raise WorkloadError("trace arrivals need a trace source.")
        times = self.process.times(self.num_requests, self.duration_s, rng)
        n = len(times) if times is not None else self.closed_count
        if n == 0:
            raise WorkloadError(
                "The arrival process produced no requests; raise duration_s or the rate."
            )
        return times, n

    @property
    def closed_loop_concurrency(self) -> int | None:
        return self.process.concurrency if isinstance(self.process, arr.ClosedLoop) else None


def plan_schedule(spec: WorkloadSpec, opts: WorkloadOptions) -> Schedule:
    """The schedule of `spec` with `opts`. The cap: the num_requests option; none when the
    duration_s option is given; the spec's num_requests when it has a duration (none if it
    gives none); else the spec's num_requests, or its source's default."""
    duration_s = opts.duration_s if opts.duration_s is not None else spec.duration_s
    if opts.num_requests is not None:
        n = opts.num_requests
    elif opts.duration_s is not None:
        n = None
    elif duration_s is not None:
        n = spec.num_requests
    elif spec.num_requests_given:
        n = spec.num_requests
    else:
        n = spec.source.default_num_requests
    process = _arrival_process(spec, opts)
    replay = spec.arrivals if process is None else {}
    return Schedule(
        process=process,
        num_requests=n,
        duration_s=duration_s,
        closed_count=int(n or spec.num_requests or 100),
        speedup=float(replay.get("speedup", 1.0)),
        jitter_s=float(replay.get("jitter_s", 0.0)),
    )


def _arrival_process(spec: WorkloadSpec, opts: WorkloadOptions) -> arr.ArrivalProcess | None:
    """The spec's process with the overrides applied; None means trace timestamps."""
    raw = spec.arrivals
    if opts.concurrency is not None:
        if opts.request_rate is not None or opts.burstiness is not None:
            raise WorkloadError(
                "Give either concurrency (closed loop) or request_rate/burstiness, not both."
            )
        return arr.ClosedLoop(concurrency=opts.concurrency)
    if opts.request_rate is not None and math.isinf(opts.request_rate):
        if opts.burstiness is not None:
            raise WorkloadError("burstiness needs a finite request_rate.")
        return arr.AllAtOnce()
    kind = raw["process"]
    spec_process = None
    if kind != "trace":
        where = spec.where / "arrivals"
        with ys.relocating(where):
            spec_process = arr.arrivals_from_spec(raw, where=str(where))
    if opts.request_rate is None and opts.burstiness is None:
        return spec_process
    rate = opts.request_rate if opts.request_rate is not None else raw.get("rate")
    if rate is None:
        raise WorkloadError(
            f"burstiness needs a request rate; the {kind!r} arrivals have none, so give request_rate."
        )
    if opts.burstiness is not None:
        shape = opts.burstiness
    elif kind == "gamma":
        shape = float(raw["burstiness"])
    elif kind == "constant":
        shape = math.inf
    else:
        shape = 1.0
    return arr.GammaProcess(
        rate=float(rate), burstiness=shape, normalize_total=bool(raw.get("normalize_total", True))
    )
