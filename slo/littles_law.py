"""Little's law per load phase: does the number of requests in flight match what the arrival
rate and the time in system predict, phase by phase?

For a phase [a, b] (`slo.load_phases`): lambda = the requests it sent (those its stage
scheduled) / (b - a); W = the mean time in system (t_done - t_sent) of those requests; the
prediction is lambda x W. The
measurement, L, is the time average over [a, b] of N(t), the requests in flight (sent, not
yet done) at t, whenever they were sent, integrated exactly from the send and done times
(`slo.consistency.mean_in_flight`: a step function, no sampling). The ratio L / (lambda x W)
is near 1 when the phase is long against W and the system is in a steady state. It moves away
from 1 when the phase never reached one: a phase whose latency keeps rising (a queue growing
under overload) has requests that finish after it ends, so W counts time that L, cut at b,
does not (ratio below 1); the phase after it inherits that backlog in L but not in lambda
(ratio above 1). Requests that were sent and never finished (lost, or an interrupted run)
count in lambda, not in W, and stay in flight to the end: `unfinished` says how many.

The whole-run check (first send to last done) is `slo.consistency.littles_law`.
"""

from __future__ import annotations

import numpy as np

from slo.consistency import mean_in_flight
from slo.load_phases import LoadPhase, phase_of
from slo.metrics import NS_PER_S
from slo.runrecord.overload_sections import PhaseLittle


def phase_little(
    t_sent_ns: np.ndarray, t_done_ns: np.ndarray, phase: LoadPhase, in_phase: np.ndarray
) -> PhaseLittle:
    """Little's law over `phase` (module docstring). `t_sent_ns` and `t_done_ns` are every
    sent request's times (ns from t0, NaN done: never finished); `in_phase` marks the
    phase's requests. A phase of no length has no rate, prediction or ratio; one without finished
    requests has no W."""
    sent = np.asarray(t_sent_ns, float)
    done = np.asarray(t_done_ns, float)
    length_s = phase.length_s
    latency_s = (done[in_phase] - sent[in_phase]) / NS_PER_S
    finished = ~np.isnan(latency_s)
    w_s = float(latency_s[finished].mean()) if finished.any() else None
    rate = float(in_phase.sum()) / length_s if length_s > 0 else None
    predicted = rate * w_s if rate is not None and w_s is not None else None
    measured, peak = (None, None)
    if length_s > 0:
        measured, peak = mean_in_flight(sent, done, phase.start_ns, phase.end_ns)
    return PhaseLittle(
        arrival_rate_per_s=rate,
        mean_time_in_system_s=w_s,
        predicted_in_flight=predicted,
        mean_in_flight=measured,
        peak_in_flight=peak,
        ratio=measured / predicted if measured is not None and predicted else None,
        unfinished=int((~finished).sum()),
    )


def littles_law_by_phase(
    t_scheduled_ns: np.ndarray,
    t_sent_ns: np.ndarray,
    t_done_ns: np.ndarray,
    phases: list[LoadPhase],
) -> list[PhaseLittle]:
    """`phase_little` for each of `phases`, each phase holding its requests
    (`slo.load_phases.phase_of`)."""
    index = phase_of(t_scheduled_ns, t_sent_ns, phases)
    return [phase_little(t_sent_ns, t_done_ns, p, index == p.index) for p in phases]
