"""Load phases: the stretches of a run that each had one offered load, so that a run can be
cut where its load changed.

A workload whose arrivals are `stages` (`workloads.arrivals.Stages`) says its phases itself:
its manifest keeps the stages it was built with (`parameters.effective.arrivals`, which the
run's `manifest.json` holds under `workload`), and phase k runs from the sum of the earlier
stages' durations for `duration_s` seconds, on the clock of the run's tables (offsets from
`t0_ns`, where the schedule's `arrival_s` starts). Any other run is one phase, from its first
send to its last send.

A request belongs to the phase whose stage drew it: phase k holds the requests scheduled in
(start_k, end_k], as a stage's arrival process draws them (renewal times after its start, up
to its end: evenly spaced arrivals put a stage's last one on its end). An open-loop run sends
each within its dispatch lag of that time; a request without a scheduled time goes by its
send. A send after the last stage's end (a late dispatcher, a concurrency cap) moves the last
phase's end to that send, so the phases cover every request in flight while the run sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from slo.metrics import NS_PER_S

STAGED = "stages"  # the arrival process whose stages are phases (workloads.arrivals.Stages)


@dataclass(frozen=True)
class LoadPhase:
    """One phase: `index` from 0, [`start_ns`, `end_ns`] relative to t0, and the stage's
    offered rate (requests/s; None for the one phase of a run without stages)."""

    index: int
    start_ns: float
    end_ns: float
    offered_rate_per_s: float | None = None

    @property
    def length_s(self) -> float:
        return (self.end_ns - self.start_ns) / NS_PER_S


def workload_stages(workload: dict | None) -> list[tuple[float, float]]:
    """(duration_s, rate) of each stage the run's workload manifest records as built; [] when
    its arrivals are not staged (or the manifest predates the record, or is malformed)."""
    params = (workload or {}).get("parameters")
    effective = params.get("effective") if isinstance(params, dict) else None
    arrivals = effective.get("arrivals") if isinstance(effective, dict) else None
    if not isinstance(arrivals, dict) or arrivals.get("process") != STAGED:
        return []
    stages = []
    for stage in arrivals.get(STAGED) or []:
        try:
            duration_s, rate = float(stage["duration_s"]), float(stage["rate"])
        except (KeyError, TypeError, ValueError):
            return []
        if not (duration_s > 0 and math.isfinite(duration_s)):
            return []
        stages.append((duration_s, rate))
    return stages


def load_phases(workload: dict | Any, t_sent_ns: np.ndarray) -> list[LoadPhase]:
    """The run's phases (see the module docstring) for the workload manifest `workload` and
    the send times `t_sent_ns` (ns from t0, NaN: never sent); [] when nothing was sent."""
    sent = np.asarray(t_sent_ns, float)
    sent = sent[~np.isnan(sent)]
    if sent.size == 0:
        return []
    stages = workload_stages(workload)
    if not stages:
        return [LoadPhase(0, float(sent.min()), float(sent.max()))]
    phases = []
    start_s = 0.0
    for k, (duration_s, rate) in enumerate(stages):
        phases.append(LoadPhase(k, start_s * NS_PER_S, (start_s + duration_s) * NS_PER_S, rate))
        start_s += duration_s
    last = phases[-1]
    if sent.max() > last.end_ns:
        phases[-1] = LoadPhase(
            last.index, last.start_ns, float(sent.max()), last.offered_rate_per_s
        )
    return phases


def phase_of(
    t_scheduled_ns: np.ndarray, t_sent_ns: np.ndarray, phases: list[LoadPhase]
) -> np.ndarray:
    """The index of the phase of each request (module docstring): by its scheduled time, else
    its send time; -1 for a request never sent, and for every request when there are no
    phases."""
    sent = np.asarray(t_sent_ns, float)
    when = np.asarray(t_scheduled_ns, float)
    when = np.where(np.isnan(when), sent, when)
    out = np.full(sent.shape, -1, dtype=np.int64)
    if not phases:
        return out
    ends = np.array([p.end_ns for p in phases])
    was_sent = ~np.isnan(sent)
    index = np.searchsorted(ends, when[was_sent], side="left")
    out[was_sent] = np.minimum(index, len(phases) - 1)
    return out
