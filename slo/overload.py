"""A run under overload: its load phases, what the target shed, and how long its latency took to
come back once the load fell.

Phases (`slo.load_phases`) are the workload's stages, or the whole run as one. Each has a
kind (`PhaseKind`): the peak runs from the first phase offered more than the first phase's
rate to the last such phase (the ramp and hold of the `overload` workload); the phases before
it are the base, those after it are after the peak. A run without stages is one phase of kind
`run`, and has no peak (nor does a staged run whose rate never rises above its first stage's:
all its phases are base).

Shedding: a shed request is one the target refused explicitly (status `rejected`, HTTP 429).
Shedding started at the send time of the first shed request (seconds from t0), in that
request's phase; counts and shares are over the sent requests (per phase: the phase's, as
`slo.load_phases` assigns them), and the reasons are the error messages the target gave (the
error class where it gave none).

Recovery: after the last peak phase ends (`peak_end_s`), the requests of the phases after
the peak, in send order, are read through a rolling window of `window_requests` (8)
consecutive requests; the rolling latency is the TTFT p90 of a window (linear interpolation).
The base level is the TTFT p90 of the base phases' ok requests; the latency has recovered at
the first window whose requests all have a TTFT (none shed, failed, or ok without a token:
the target still refusing work has not recovered) and whose p90 is at most the base level x
(1 + `tolerance`) (0.5: within 50%). `recovery_s` is the send time of that window's first
request, less `peak_end_s`: from then on the target served new requests about as fast as
before the peak. Without a figure, `recovery` (an `OverloadRecovery`) says why: no window got
back (`not_recovered`: not within the run), fewer than `window_requests` requests after the
peak (`too_few_after`), no TTFT in the base phases (`no_base_level`: none ok, or the run was
not streamed), or no peak phase (`no_peak`).

The block is there only for a run with load phases (staged arrivals) or shed requests: a plain
run's summary has none.
"""

from __future__ import annotations

from collections import Counter
from enum import StrEnum

import numpy as np

from slo import metrics
from slo.frame import RequestMetrics
from slo.littles_law import phase_little
from slo.load_phases import STAGED, LoadPhase, load_phases, phase_of, workload_stages
from slo.runrecord import RequestStatus
from slo.runrecord.overload_sections import Overload, PhaseLoad
from slo.runrecord.sections import Latencies

RECOVERY_WINDOW_REQUESTS = 8
RECOVERY_TOLERANCE = 0.5
RECOVERY_PERCENTILE = 90
WHOLE_RUN = "run"  # `phase_source` of a run without stages


class PhaseKind(StrEnum):
    """What a phase is to the overload (the module docstring says how each is chosen)."""

    BASE = "base"
    PEAK = "peak"
    AFTER_PEAK = "after_peak"
    RUN = "run"


class OverloadRecovery(StrEnum):
    """How the recovery after the peak was judged (the module docstring says when)."""

    RECOVERED = "recovered"
    NOT_RECOVERED = "not_recovered"
    TOO_FEW_AFTER = "too_few_after"
    NO_BASE_LEVEL = "no_base_level"
    NO_PEAK = "no_peak"


def phase_kinds(phases: list[LoadPhase]) -> list[PhaseKind]:
    """The kind of each phase: base, peak or after the peak; `run` for a run without stages."""
    if not phases or phases[0].offered_rate_per_s is None:
        return [PhaseKind.RUN] * len(phases)
    base_rate = phases[0].offered_rate_per_s
    peaks = [k for k, p in enumerate(phases) if (p.offered_rate_per_s or 0.0) > base_rate]
    if not peaks:
        return [PhaseKind.BASE] * len(phases)
    first, last = peaks[0], peaks[-1]
    before, after = [PhaseKind.BASE] * first, [PhaseKind.AFTER_PEAK] * (len(phases) - last - 1)
    return [*before, *[PhaseKind.PEAK] * (last - first + 1), *after]


def shed_reasons(rm: RequestMetrics, shed: np.ndarray) -> dict[str, int]:
    """error message (else error class) -> count over the shed requests, most frequent first."""
    reasons = Counter(
        str(message or error_class or RequestStatus.REJECTED.value)
        for message, error_class in zip(rm.error_message[shed], rm.error_class[shed], strict=True)
    )
    return dict(sorted(reasons.items(), key=lambda item: (-item[1], item[0])))


def rolling_recovery(
    t_sent_ns: np.ndarray,
    ttft_ms: np.ndarray,
    *,
    after_ns: float,
    threshold_ms: float,
    window_requests: int = RECOVERY_WINDOW_REQUESTS,
) -> tuple[float | None, OverloadRecovery]:
    """(seconds from `after_ns` to the send of the first request of the first recovered
    window, how it was judged) over the requests given (those after the peak; a NaN TTFT: not
    served), in send order. A window has recovered when every request in it has a TTFT and
    their p90 is at most `threshold_ms`."""
    order = np.argsort(np.asarray(t_sent_ns, float), kind="stable")
    sent = np.asarray(t_sent_ns, float)[order]
    ttft = np.asarray(ttft_ms, float)[order]
    if sent.size < window_requests:
        return None, OverloadRecovery.TOO_FEW_AFTER
    unserved = np.lib.stride_tricks.sliding_window_view(np.isnan(ttft), window_requests)
    windows = np.lib.stride_tricks.sliding_window_view(np.nan_to_num(ttft), window_requests)
    rolling = np.percentile(windows, RECOVERY_PERCENTILE, axis=1, method="linear")
    back = np.flatnonzero(~unserved.any(axis=1) & (rolling <= threshold_ms))
    if back.size == 0:
        return None, OverloadRecovery.NOT_RECOVERED
    return float(sent[back[0]] - after_ns) / metrics.NS_PER_S, OverloadRecovery.RECOVERED


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _phase_load(
    rm: RequestMetrics, phase: LoadPhase, kind: PhaseKind, index: np.ndarray, shed: np.ndarray
) -> PhaseLoad:
    in_phase = index == phase.index
    ok = in_phase & rm.is_ok
    n_sent, n_shed = int(in_phase.sum()), int((in_phase & shed).sum())
    latency = Latencies.from_dict(
        {
            "ttft": metrics.distribution(rm.ttft_ms[ok]),
            "e2e": metrics.distribution(rm.e2e_ms[ok]),
        }
    )
    return PhaseLoad(
        phase=phase.index,
        kind=kind.value,
        start_s=phase.start_ns / metrics.NS_PER_S,
        end_s=phase.end_ns / metrics.NS_PER_S,
        offered_rate_per_s=phase.offered_rate_per_s,
        n_sent=n_sent,
        n_ok=int(ok.sum()),
        n_shed=n_shed,
        shed_share=_share(n_shed, n_sent),
        shed_reasons=shed_reasons(rm, in_phase & shed),
        latency_ms=latency,
        little_law=phase_little(rm.t_sent_ns, rm.t_done_ns, phase, in_phase),
    )


def _recovery(
    rm: RequestMetrics,
    phases: list[LoadPhase],
    kinds: list[PhaseKind],
    index: np.ndarray,
    *,
    tolerance: float,
    window_requests: int,
):
    """(peak end ns, base TTFT p90 ms, threshold ms, recovery_s, judged) of the module
    docstring's recovery rule, None where there is no such figure."""
    base = np.isin(
        index, [p.index for p, k in zip(phases, kinds, strict=True) if k is PhaseKind.BASE]
    )
    base_p90 = metrics.percentile(rm.ttft_ms[base & rm.is_ok], RECOVERY_PERCENTILE)
    threshold = None if base_p90 is None else base_p90 * (1.0 + tolerance)
    peaks = [p for p, k in zip(phases, kinds, strict=True) if k is PhaseKind.PEAK]
    if not peaks:
        return None, base_p90, threshold, None, OverloadRecovery.NO_PEAK
    if threshold is None:
        return peaks[-1].end_ns, base_p90, None, None, OverloadRecovery.NO_BASE_LEVEL
    after = index > peaks[-1].index
    served_ttft = np.where(rm.is_ok, rm.ttft_ms, np.nan)
    recovery_s, judged = rolling_recovery(
        rm.t_sent_ns[after],
        served_ttft[after],
        after_ns=peaks[-1].end_ns,
        threshold_ms=threshold,
        window_requests=window_requests,
    )
    return peaks[-1].end_ns, base_p90, threshold, recovery_s, judged


def overload_summary(
    rm: RequestMetrics,
    workload: dict | None,
    *,
    window_requests: int = RECOVERY_WINDOW_REQUESTS,
    tolerance: float = RECOVERY_TOLERANCE,
) -> Overload | None:
    """The `overload` block (module docstring) of the sent requests `rm` of a run whose
    workload manifest is `workload`; None for a run without stages and without shed
    requests."""
    shed = rm.status == RequestStatus.REJECTED.value
    staged = bool(workload_stages(workload))
    phases = load_phases(workload, rm.t_sent_ns)
    if not phases or not (staged or shed.any()):
        return None
    kinds = phase_kinds(phases)
    index = phase_of(rm.t_scheduled_ns, rm.t_sent_ns, phases)
    rows = [_phase_load(rm, p, k, index, shed) for p, k in zip(phases, kinds, strict=True)]
    first_shed_s, first_shed_phase = None, None
    if shed.any():
        first = int(np.flatnonzero(shed)[np.argmin(rm.t_sent_ns[shed])])
        first_shed_s, first_shed_phase = rm.t_sent_ns[first] / metrics.NS_PER_S, int(index[first])
    peak_end_ns, base_p90, threshold, recovery_s, judged = _recovery(
        rm, phases, kinds, index, tolerance=tolerance, window_requests=window_requests
    )
    n_sent, n_shed = len(rm), int(shed.sum())
    return Overload(
        phase_source=STAGED if staged else WHOLE_RUN,
        phases=rows,
        n_sent=n_sent,
        n_shed=n_shed,
        shed_share=_share(n_shed, n_sent),
        shed_reasons=shed_reasons(rm, shed),
        first_shed_s=None if first_shed_s is None else float(first_shed_s),
        first_shed_phase=first_shed_phase,
        peak_end_s=None if peak_end_ns is None else peak_end_ns / metrics.NS_PER_S,
        base_ttft_p90_ms=base_p90,
        recovery_threshold_ms=threshold,
        recovery_window_requests=window_requests,
        recovery_tolerance=tolerance,
        recovery_s=recovery_s,
        recovery=judged.value,
    )
