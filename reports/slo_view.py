"""Reading the SLO parts of a run's summary (verdicts, headline, slices).

`slo` computes every figure; this module only picks them out of the typed summary
(`slo.runrecord.RunSummary`), tolerating fields that an older summary lacks: an absent field
reads as None, never as 0.
"""

from __future__ import annotations

from reports.card import VERDICTS, SliceRow, SLOVerdict
from slo.runrecord import Distribution, Latencies, RequestStatus, RunSummary


def has_slo(summary: RunSummary, spec: dict | None) -> bool:
    """Whether the run is judged by an SLO: the summary evaluated one, or one is given."""
    return summary.slo is not None or bool(spec)


def verdicts(summary: RunSummary) -> list[SLOVerdict]:
    """One SLOVerdict per objective of the summary's `slo` (empty when the run had no SLO)."""
    if summary.slo is None:
        return []
    out = []
    for objective in summary.slo.objectives or []:
        ci = objective.ci
        ci = ci if isinstance(ci, list | tuple) and len(ci) >= 2 else [None, None]
        kind = objective.kind or "percentile"
        out.append(
            SLOVerdict(
                objective=_objective_name(objective),
                metric=str(objective.metric or kind),
                unit="ms" if kind == "percentile" else "fraction",
                observed=objective.measured,
                threshold=objective.threshold,
                ci_low=ci[0],
                ci_high=ci[1],
                n=objective.n,
                verdict=objective.verdict if objective.verdict in VERDICTS else "inconclusive",
                reason=objective.reason,
            )
        )
    return out


def _objective_name(objective) -> str:
    """The objective's name, with the TTFT it judged where the summary says (`slo.reasoning`)."""
    name = "?" if objective.name is None else str(objective.name)
    return f"{name} (TTFT to {objective.ttft.replace('_', ' ')})" if objective.ttft else name


def headline(summary: RunSummary, slo_verdicts: list[SLOVerdict], *, has_slo: bool) -> str:
    """The run's SLO verdict: slo's overall verdict when given, else fail if any objective
    failed, inconclusive if any was (or none were judged), pass otherwise; no_slo without
    an SLO."""
    if not has_slo:
        return "no_slo"
    overall = summary.slo.verdict if summary.slo is not None else None
    if overall in VERDICTS:
        return overall
    words = {v.verdict for v in slo_verdicts}
    if "fail" in words:
        return "fail"
    if "inconclusive" in words or not words:
        return "inconclusive"
    return "pass"


def slo_name(summary: RunSummary, spec: dict | None) -> str | None:
    """The SLO's name: from the summary's evaluated spec, else the given spec, else None."""
    evaluated = (summary.slo.spec if summary.slo is not None else None) or {}
    name = evaluated.get("name") or (spec or {}).get("name")
    return None if name is None else str(name)


def slices(summary: RunSummary) -> list[SliceRow]:
    """SliceRows from the summary's `slices` (input tokens, output tokens, in flight, time),
    empty slices left out."""
    out = []
    for dimension, entries in summary.slices.dimensions():
        for entry in entries:
            if entry is None or not entry.n:
                continue
            latency = entry.latency_ms or Latencies.empty()
            empty = Distribution.empty()
            ttft, tpot, e2e = (d or empty for d in (latency.ttft, latency.tpot, latency.e2e))
            out.append(
                SliceRow(
                    dimension=dimension,
                    value="?" if entry.label is None else str(entry.label),
                    n=int(entry.n),
                    n_ok=int((entry.counts or {}).get(RequestStatus.OK, 0)),
                    ttft_p50_ms=ttft.p50,
                    ttft_p99_ms=ttft.p99,
                    tpot_p50_ms=tpot.p50,
                    tpot_p99_ms=tpot.p99,
                    e2e_p99_ms=e2e.p99,
                    attainment=entry.attainment,
                )
            )
    return out
