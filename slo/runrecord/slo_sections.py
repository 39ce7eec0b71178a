"""The judged blocks of `summary.json`: SLO verdicts, goodput, slices, fault recovery and the
other tools' conventions (the run's own figures are in `slo.runrecord.sections`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

from slo.runrecord.section import Section, keyed, listed, nested
from slo.runrecord.sections import Distribution, Latencies

_UNDEFINED = "undefined"  # the conventions key beside the tools: why there are none


@dataclass(frozen=True)
class ObjectiveVerdict(Section):
    """One objective of `slo.objectives` (`slo.verdicts`): `kind` is `percentile` (with
    `metric` and `percentile`; `threshold` and `measured` in ms) or a rate (`attainment`,
    `error_rate`: fractions); `ci` is [low, high] or None; `verdict` pass, fail or
    inconclusive, with `reason`. `ttft` (`slo.reasoning`): which TTFT an objective that reads
    it judged, `first_token` or `first_answer_token`, in a run with reasoning or under a spec
    that asks for the first answer token; absent otherwise."""

    name: str | None = None
    kind: str | None = None
    metric: str | None = None
    percentile: float | None = None
    threshold: float | None = None
    measured: float | None = None
    ci: list | None = None
    n: int | None = None
    n_bad: int | None = None
    allowed_bad_fraction: float | None = None
    verdict: str | None = None
    samples_to_pass: int | None = None
    reason: str | None = None
    ttft: str | None = None
    quantiles: str | None = None  # `itl_ms` objectives: exact or sketch, as `Distribution`'s
    relative_error: float | None = None


@dataclass(frozen=True)
class SLOEvaluation(Section):
    """`slo` (`slo.verdicts.evaluate`): the spec's dict, the overall verdict, one entry per
    objective; `ttft` as each objective's (`ObjectiveVerdict`)."""

    spec: dict | None = None
    verdict: str | None = None
    objectives: list[ObjectiveVerdict] | None = listed(ObjectiveVerdict)
    ttft: str | None = None


@dataclass(frozen=True)
class Goodput(Section):
    """`goodput` (`slo.goodput.goodput_summary`): good requests (ok within every per-request
    objective) and their rates; `misses` counts the requests missing each objective."""

    attainment: float | None = None
    good_requests: int | None = None
    total_requests: int | None = None
    request_per_s: float | None = None
    output_tokens_per_s: float | None = None
    total_tokens_per_s: float | None = None
    misses: dict | None = None
    definition: str | None = None


@dataclass(frozen=True)
class SliceStats(Section):
    """One slice (`slo.slices.slice_summary`): `range` is [low, high); `counts` by status;
    `sent_request_per_s` and `goodput_request_per_s` for time slices; `good_requests` and
    `attainment` with an SLO."""

    label: str | None = None
    range: list | None = None
    n: int | None = None
    counts: dict | None = None
    error_rate: float | None = None
    latency_ms: Latencies | None = nested(Latencies)
    sent_request_per_s: float | None = None
    good_requests: int | None = None
    attainment: float | None = None
    goodput_request_per_s: float | None = None


@dataclass(frozen=True)
class Slices(Section):
    """`slices` (`slo.slices.slices_summary`): the slices of each dimension; `time` only with
    a slice duration."""

    input_tokens: list[SliceStats] | None = listed(SliceStats)
    output_tokens: list[SliceStats] | None = listed(SliceStats)
    in_flight: list[SliceStats] | None = listed(SliceStats)
    time: list[SliceStats] | None = listed(SliceStats)
    tenant: list[SliceStats] | None = listed(SliceStats)  # runs whose requests have tenants
    priority: list[SliceStats] | None = listed(SliceStats)  # runs whose requests have priorities

    def dimensions(self) -> list[tuple[str, list[SliceStats]]]:
        """(dimension, its slices) for each dimension the summary has, in field order."""
        return [(name, getattr(self, name) or []) for name in self.json_keys()]


@dataclass(frozen=True)
class TenantShare(Section):
    """One tenant of `fairness`: its demand, goodput, max-min fair share (requests/s) and
    goodput / fair share."""

    tenant: str | None = None
    sent_request_per_s: float | None = None
    goodput_request_per_s: float | None = None
    fair_share_request_per_s: float | None = None
    normalised_goodput: float | None = None


@dataclass(frozen=True)
class Fairness(Section):
    """`fairness` (`slo.classes.fairness_summary`): Jain's index over the tenants' goodput
    normalised by their max-min fair shares (`raw_jain_index`: over raw goodput)."""

    jain_index: float | None = None
    raw_jain_index: float | None = None
    definition: str | None = None
    window_s: float | None = None
    tenants: list[TenantShare] | None = listed(TenantShare)


@dataclass(frozen=True)
class Deadlines(Section):
    """`deadlines` (`slo.classes.deadlines_summary`): requests with a deadline, met and
    missed, and the misses by kind."""

    with_deadline: int | None = None
    met_deadline: int | None = None
    missed_deadline: int | None = None
    miss_rate: float | None = None
    finished_late: int | None = None
    dropped_by_server: int | None = None
    rejected_at_admission: int | None = None
    failed_otherwise: int | None = None
    definition: str | None = None


@dataclass(frozen=True)
class FaultWindow(Section):
    """One fault window's recovery (`slo.recovery.recovery_for_window`): goodput before and
    during it; `recovery_s`, or None with `recovery` saying why."""

    kind: str | None = None
    start_s: float | None = None
    end_s: float | None = None
    goodput_before_per_s: float | None = None
    goodput_during_per_s: float | None = None
    recovery_s: float | None = None
    recovery: str | None = None
    recovery_bin_s: float | None = None
    attainment_in_window: float | None = None
    requests_in_window: int | None = None
    outcomes_in_window: dict | None = None


@dataclass(frozen=True)
class Faults(Section):
    """`faults`: the fault plan's name and hash, and each applied window's recovery."""

    plan: str | None = None
    sha256: str | None = None
    windows: list[FaultWindow] | None = listed(FaultWindow)


@dataclass(frozen=True)
class ConventionMetric(Distribution):
    """One metric of a tool's conventions: its distribution (ms) and one-line definition."""

    definition: str | None = None


@dataclass(frozen=True)
class ConventionRate(Section):
    """One throughput of a tool's conventions (per second) and its definition."""

    value: float | None = None
    definition: str | None = None


@dataclass(frozen=True)
class ToolConvention(Section):
    """One tool's conventions (`slo.conventions.conventions_summary`): where they come from,
    how it takes percentiles, its metrics and throughputs by the tool's own names."""

    source: str | None = None
    percentile_method: str | None = None
    metrics: dict[str, ConventionMetric] | None = keyed(ConventionMetric)
    throughput: dict[str, ConventionRate] | None = keyed(ConventionRate)


@dataclass(frozen=True)
class Conventions(Section):
    """`conventions`: `tools` maps a tool (`harness`, `vllm`, `guidellm`, `aiperf`, `mlperf`)
    to its conventions; a non-streamed run has none and `undefined` says why. In JSON the
    tools are keys of the block itself, beside `undefined`."""

    undefined: str | None = None
    tools: dict[str, ToolConvention] = field(default_factory=dict)

    @classmethod
    def key_names(cls) -> tuple[str, ...]:
        return (_UNDEFINED, "<tool>")

    @classmethod
    def from_dict(cls, data: Any) -> Self | None:
        """The block of `data`; an entry that is not an object is not a tool."""
        if not isinstance(data, dict):
            return None
        tools = {k: ToolConvention.from_dict(v) for k, v in data.items() if k != _UNDEFINED}
        section = cls(
            undefined=data.get(_UNDEFINED),
            tools={k: v for k, v in tools.items() if v is not None},
        )
        object.__setattr__(section, "_keys", (_UNDEFINED,) if _UNDEFINED in data else ())
        return section

    def to_dict(self) -> dict:
        read = getattr(self, "_keys", None)
        has_why = _UNDEFINED in read if read is not None else self.undefined is not None
        head = {_UNDEFINED: self.undefined} if has_why else {}
        return {**head, **{tool: block.to_dict() for tool, block in self.tools.items()}}
