"""Reading the SLO parts of an `slo.summarize` result (verdicts, goodput, slices, intervals).

`slo` computes every figure; this module only picks them out of the summary dict (layout in
the `slo` package docstring), tolerating fields that an older summary lacks: an absent field
reads as None, never as 0.
"""

from __future__ import annotations

from reports.card import VERDICTS, SliceRow, SLOVerdict
from slo.runrecord import RequestStatus

GOODPUT_KEYS = (
    "request_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "attainment",
    "good_requests",
    "total_requests",
)
SLICE_DIMENSIONS = ("input_tokens", "output_tokens", "in_flight", "time")


def interval(block: dict, statistic: str) -> list[float] | None:
    """The [low, high] interval slo gave for `statistic` (e.g. "p99") in `block`, or None.

    Reads `{"ci": {"p99": [lo, hi]}}` or `{"p99_ci": [lo, hi]}`.
    """
    ci = block.get("ci")
    pair = ci.get(statistic) if isinstance(ci, dict) else block.get(f"{statistic}_ci")
    if not isinstance(pair, list | tuple) or len(pair) < 2 or None in pair[:2]:
        return None
    return [float(pair[0]), float(pair[1])]


def verdicts(summary: dict) -> list[SLOVerdict]:
    """One SLOVerdict per objective of `summary["slo"]` (empty when the run had no SLO)."""
    block = summary.get("slo")
    if not isinstance(block, dict):
        return []
    out = []
    for objective in block.get("objectives") or []:
        ci = objective.get("ci")
        ci = ci if isinstance(ci, list | tuple) and len(ci) >= 2 else [None, None]
        verdict = objective.get("verdict")
        kind = objective.get("kind", "percentile")
        out.append(
            SLOVerdict(
                objective=str(objective.get("name", "?")),
                metric=str(objective.get("metric") or kind),
                unit="ms" if kind == "percentile" else "fraction",
                observed=objective.get("measured"),
                threshold=objective.get("threshold"),
                ci_low=ci[0],
                ci_high=ci[1],
                n=objective.get("n"),
                verdict=verdict if verdict in VERDICTS else "inconclusive",
                reason=objective.get("reason"),
            )
        )
    return out


def headline(summary: dict, slo_verdicts: list[SLOVerdict], *, has_slo: bool) -> str:
    """The run's SLO verdict: slo's overall verdict when given, else fail if any objective
    failed, inconclusive if any was (or none were judged), pass otherwise; no_slo without
    an SLO."""
    if not has_slo:
        return "no_slo"
    overall = (summary.get("slo") or {}).get("verdict")
    if overall in VERDICTS:
        return overall
    words = {v.verdict for v in slo_verdicts}
    if "fail" in words:
        return "fail"
    if "inconclusive" in words or not words:
        return "inconclusive"
    return "pass"


def slo_name(summary: dict, spec: dict | None) -> str | None:
    """The SLO's name: from the summary's evaluated spec, else the given spec, else None."""
    evaluated = (summary.get("slo") or {}).get("spec") or {}
    name = evaluated.get("name") or (spec or {}).get("name")
    return None if name is None else str(name)


def goodput(summary: dict) -> dict | None:
    """The scalar goodput figures slo gave (GOODPUT_KEYS present), or None without an SLO."""
    value = summary.get("goodput")
    if not isinstance(value, dict):
        return None
    return {k: value[k] for k in GOODPUT_KEYS if k in value}


def slices(summary: dict) -> list[SliceRow]:
    """SliceRows from `summary["slices"]` (`{dimension: [{label, n, counts, latency_ms,
    attainment, ...}]}`), dimensions in SLICE_DIMENSIONS order, empty slices left out."""
    raw = summary.get("slices")
    if not isinstance(raw, dict):
        return []
    dims = [d for d in SLICE_DIMENSIONS if d in raw] + sorted(set(raw) - set(SLICE_DIMENSIONS))
    out = []
    for dimension in dims:
        for entry in raw[dimension] or []:
            if not entry.get("n"):
                continue
            latency = entry.get("latency_ms") or {}

            def stat(metric: str, key: str, latency=latency):
                return (latency.get(metric) or {}).get(key)

            out.append(
                SliceRow(
                    dimension=dimension,
                    value=str(entry.get("label", "?")),
                    n=int(entry["n"]),
                    n_ok=int((entry.get("counts") or {}).get(RequestStatus.OK, 0)),
                    ttft_p50_ms=stat("ttft", "p50"),
                    ttft_p99_ms=stat("ttft", "p99"),
                    tpot_p50_ms=stat("tpot", "p50"),
                    tpot_p99_ms=stat("tpot", "p99"),
                    e2e_p99_ms=stat("e2e", "p99"),
                    attainment=entry.get("attainment"),
                )
            )
    return out
