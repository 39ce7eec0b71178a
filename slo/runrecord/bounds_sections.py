"""The `bounds` block of `summary.json`: the seed's lower bounds (KV bytes, transfer time) and
Little's law, each beside what the run measured and their ratio, with the cost per million
output tokens at the SLO and the energy per output token.

Written by `slo.bounds.bounds_summary` (the bounds; Little's law from `slo.littles_law`),
`slo.cost.cost_summary` and `slo.cost.energy_summary`; the definitions are in those modules'
docstrings. Every ratio is measured / bound; bytes are bytes, times seconds from t0, money US
dollars, energy joules; "no value" is None, and `absent` says why a whole figure is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

from slo.runrecord.overload_sections import PhaseLittle
from slo.runrecord.section import Section, listed, nested
from slo.runrecord.sections import Distribution


@dataclass(frozen=True)
class KVRequestBound(Section):
    """M_KV per request (`slo.bounds.kv_request_bound`): `bound_bytes` and `measured_bytes`
    summed over the `n` ok requests the engine reported KV bytes for (`ratio` of the sums);
    `ratio_per_request` over those requests, and `explained_ratio`, the ratio block rounding
    and the pool's per-token bytes alone predict for each; `below_bound` counts requests
    measured under their bound, `evicted` those that had tokens evicted."""

    formula: str | None = None
    bytes_per_token: int | None = None  # 2 L A_kv d_h s: the bound's bytes per token
    pool_bytes_per_token: int | None = None  # what the engine's pool spends (scales included)
    n: int | None = None
    bound_bytes: float | None = None
    measured_bytes: float | None = None
    ratio: float | None = None
    ratio_per_request: Distribution | None = nested(Distribution)
    explained_ratio: Distribution | None = nested(Distribution)
    below_bound: int | None = None
    evicted: int | None = None
    why_differs: str | None = None
    absent: str | None = None


@dataclass(frozen=True)
class KVPeakBound(Section):
    """M_KV of the run's peak in-flight set (`slo.bounds.kv_peak_bound`): at `peak_s` (s from
    t0), `in_flight` requests held `tokens_held` tokens (`approximation` says how that is
    counted), whose bound is `bound_bytes`. The gauge is compared at the scrape (`sample_s`)
    that saw the most tokens held, whose bound is `sample_bound_bytes`: `measured_bytes` is the
    engine's KV gauge times its pool there, `ratio` = measured_bytes / sample_bound_bytes;
    `measured_max_bytes` the gauge's largest value over the run, in bytes."""

    formula: str | None = None
    approximation: str | None = None
    peak_s: float | None = None
    in_flight: int | None = None
    tokens_held: int | None = None
    bound_bytes: float | None = None
    sample_s: float | None = None
    sample_bound_bytes: float | None = None
    measured_bytes: float | None = None
    ratio: float | None = None
    measured_max_bytes: float | None = None
    why_differs: str | None = None
    absent: str | None = None


@dataclass(frozen=True)
class PhaseLittleBound(Section):
    """Little's law over one load phase (`slo.load_phases`): its number, [start_s, end_s], and
    `slo.littles_law.phase_little` (the prediction lambda x W stands where the bounds have
    their bound, the mean in flight L where they have the measured figure)."""

    phase: int | None = None
    start_s: float | None = None
    end_s: float | None = None
    little_law: PhaseLittle | None = nested(PhaseLittle)


@dataclass(frozen=True)
class LittleBounds(Section):
    """Little's law per load phase (`slo.bounds.little_bounds`)."""

    formula: str | None = None
    phases: list[PhaseLittleBound] | None = listed(PhaseLittleBound)
    why_differs: str | None = None
    absent: str | None = None


@dataclass(frozen=True)
class TransferBound(Section):
    """T_transfer >= M_KV / B_effective for a prefill/decode cluster's KV moves; absent (with
    the reason) until the run records transfers."""

    formula: str | None = None
    bound_s: float | None = None
    measured_s: float | None = None
    ratio: float | None = None
    why_differs: str | None = None
    absent: str | None = None


@dataclass(frozen=True)
class Cost(Section):
    """Cost per million output tokens (`slo.cost.cost_summary`): `cost_per_hour_usd` (what the
    run was told the target costs) times the measured window is `run_cost_usd`; divided by the
    output tokens of the requests that met the SLO (`good_output_tokens`) it is
    `usd_per_million_good_tokens`, by every sent request's output tokens it is
    `usd_per_million_output_tokens`. `good_absent` and `all_absent` say why either is None."""

    formula: str | None = None
    cost_per_hour_usd: float | None = None
    window_s: float | None = None
    run_cost_usd: float | None = None
    good_output_tokens: int | None = None
    all_output_tokens: int | None = None
    usd_per_million_good_tokens: float | None = None
    usd_per_million_output_tokens: float | None = None
    good_absent: str | None = None
    all_absent: str | None = None
    absent: str | None = None


@dataclass(frozen=True)
class Energy(Section):
    """Energy over the measured phase (`slo.cost.energy_summary`, from the manifest's `energy`
    record): `joules` in all and `joules_by_counter`, over `duration_s`, `mean_power_w`, and
    `joules_per_output_token` over every sent request's output tokens; `note` says what the
    counters cover."""

    joules: float | None = None
    joules_by_counter: dict | None = None
    duration_s: float | None = None
    mean_power_w: float | None = None
    all_output_tokens: int | None = None
    joules_per_output_token: float | None = None
    note: str | None = None
    absent: str | None = None


@dataclass(frozen=True)
class Bounds(Section):
    """`bounds` (`slo.bounds.bounds_summary`): the lower bounds against the run, Little's law
    per phase, the cost per million output tokens and the energy per output token."""

    kv_request: KVRequestBound | None = nested(KVRequestBound)
    kv_peak: KVPeakBound | None = nested(KVPeakBound)
    little_law: LittleBounds | None = nested(LittleBounds)
    transfer: TransferBound | None = nested(TransferBound)
    cost: Cost | None = nested(Cost)
    energy: Energy | None = nested(Energy)


@dataclass(frozen=True)
class EnergyCounter(Section):
    """One energy counter read at the start and the end of the measured phase
    (`harness.run.energy`): `name` (`rapl:package-0`, `nvml:0`), the `joules` it counted in
    between (its wraparound undone), and `wrap_joules`, the range after which it wraps (None:
    it does not)."""

    name: str | None = None
    joules: float | None = None
    wrap_joules: float | None = None


@dataclass(frozen=True)
class EnergyRecord(Section):
    """The manifest's `energy` record (`harness.run.energy.EnergyMeter`): the `counters` read
    over `duration_s` seconds of the measured phase, or `unavailable`: why none could be read."""

    counters: list[EnergyCounter] | None = listed(EnergyCounter)
    duration_s: float | None = None
    unavailable: str | None = None
