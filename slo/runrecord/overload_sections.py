"""The `overload` block of `summary.json`: a run cut into its load phases, with Little's law,
shedding and latency per phase, and how long the latency took to come back after the peak.

Written by `slo.overload.overload_summary` (phases from `slo.load_phases`, Little's law from
`slo.littles_law`); the definitions are in those modules' docstrings. Times are seconds from
t0, rates per second, latencies ms, "no value" None.
"""

from __future__ import annotations

from dataclasses import dataclass

from slo.runrecord.section import Section, listed, nested
from slo.runrecord.sections import Latencies


@dataclass(frozen=True)
class PhaseLittle(Section):
    """Little's law over one phase (`slo.littles_law.phase_little`): `arrival_rate_per_s`
    (lambda: sends in the phase / its length), `mean_time_in_system_s` (W: mean send-to-done
    of those sends), `predicted_in_flight` (lambda x W), `mean_in_flight` (L: the exact time
    average of the requests in flight over the phase, whenever sent), `peak_in_flight`,
    `ratio` (L / (lambda x W)), `unfinished` (of the phase's requests, never done)."""

    arrival_rate_per_s: float | None = None
    mean_time_in_system_s: float | None = None
    predicted_in_flight: float | None = None
    mean_in_flight: float | None = None
    peak_in_flight: int | None = None
    ratio: float | None = None
    unfinished: int | None = None


@dataclass(frozen=True)
class PhaseLoad(Section):
    """One load phase (`slo.overload`): its number, `kind` (an `slo.overload.PhaseKind`
    value), [start_s, end_s], the stage's offered rate (None without stages), its requests
    (`slo.load_phases.phase_of`) sent, ok and shed (status `rejected`) with the share shed and the reasons (error
    message -> count), the TTFT and E2E of its ok requests, and Little's law over it."""

    phase: int | None = None
    kind: str | None = None
    start_s: float | None = None
    end_s: float | None = None
    offered_rate_per_s: float | None = None
    n_sent: int | None = None
    n_ok: int | None = None
    n_shed: int | None = None
    shed_share: float | None = None
    shed_reasons: dict | None = None
    latency_ms: Latencies | None = nested(Latencies)
    little_law: PhaseLittle | None = nested(PhaseLittle)


@dataclass(frozen=True)
class Overload(Section):
    """`overload` (`slo.overload.overload_summary`): present when the run has load phases
    (staged arrivals) or shed requests. `phase_source` is `stages` or `run` (one phase, first
    to last send). Shedding over the run (`first_shed_s` and `first_shed_phase`: the first
    shed request's send), and recovery after the last peak phase (`peak_end_s`): `recovery_s`,
    or None with `recovery` (an `slo.overload.OverloadRecovery` value) saying why, judged by
    the TTFT p90 of `recovery_window_requests` consecutive requests, all served, against
    `recovery_threshold_ms` (the base phases' TTFT p90 x (1 + `recovery_tolerance`))."""

    phase_source: str | None = None
    phases: list[PhaseLoad] | None = listed(PhaseLoad)
    n_sent: int | None = None
    n_shed: int | None = None
    shed_share: float | None = None
    shed_reasons: dict | None = None
    first_shed_s: float | None = None
    first_shed_phase: int | None = None
    peak_end_s: float | None = None
    base_ttft_p90_ms: float | None = None
    recovery_threshold_ms: float | None = None
    recovery_window_requests: int | None = None
    recovery_tolerance: float | None = None
    recovery_s: float | None = None
    recovery: str | None = None
