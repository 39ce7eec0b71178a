"""Slices: metrics and attainment by input-length bucket, output-length bucket and load phase.

Length buckets are [low, high) token ranges given by ascending edges; the last bucket is
open-ended and labelled "low+". Requests with no recorded count fall in an "unknown"
bucket (failed requests often lack an output count), so no request leaves a denominator.
Load phases split the measured window (first send to last done) into equal time windows
and assign each request by its send time; never-sent requests form an "unsent" slice.
"""

from __future__ import annotations

import numpy as np

from slo import metrics
from slo.errors import SLOError
from slo.frame import RequestMetrics
from slo.goodput import good_mask
from slo.spec import SLOSpec

DEFAULT_INPUT_EDGES = (0, 128, 512, 2048, 8192)
DEFAULT_OUTPUT_EDGES = (0, 64, 256, 1024, 4096)
DEFAULT_NUM_PHASES = 3


def bucket_labels(
    values: np.ndarray, edges: tuple[float, ...]
) -> list[tuple[str, np.ndarray, list]]:
    """(label, mask, [low, high]) per non-empty bucket of `values` by ascending `edges`."""
    edges = tuple(float(e) for e in edges)
    if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise SLOError(f"slice bucket edges must be strictly ascending, not {list(edges)}.")
    values = np.asarray(values, float)
    out = []
    for i, low in enumerate(edges):
        high = edges[i + 1] if i + 1 < len(edges) else None
        mask = values >= low
        if high is not None:
            mask &= values < high
        label = f"{low:g}-{high - 1:g}" if high is not None else f"{low:g}+"
        if mask.any():
            out.append((label, mask, [low, high]))
    below = values < edges[0]
    if below.any():
        out.insert(0, (f"<{edges[0]:g}", below, [None, edges[0]]))
    unknown = np.isnan(values)
    if unknown.any():
        out.append(("unknown", unknown, [None, None]))
    return out


def phase_masks(rm: RequestMetrics, num_phases: int) -> list[tuple[str, np.ndarray, list]]:
    """(label, mask, [start_s, end_s]) per load phase; times in s from the window start."""
    if num_phases < 1:
        raise SLOError(f"the number of load phases must be at least 1, not {num_phases}.")
    window_s = rm.window_s()
    sent = rm.t_sent_ns
    out = []
    if window_s is not None:
        start_ns = float(np.nanmin(sent))
        offsets_s = (sent - start_ns) / metrics.NS_PER_S
        phase_s = window_s / num_phases
        index = np.minimum(np.floor(offsets_s / phase_s), num_phases - 1)
        for i in range(num_phases):
            mask = index == i
            out.append((f"phase {i + 1}/{num_phases}", mask, [i * phase_s, (i + 1) * phase_s]))
    unsent = np.isnan(sent)
    if unsent.any():
        out.append(("unsent", unsent, [None, None]))
    return out


def slice_summary(
    rm: RequestMetrics, mask: np.ndarray, spec: SLOSpec | None, duration_s: float | None
) -> dict:
    """Counts, error rate, latency distributions and (with a spec) attainment for a slice.

    With `duration_s` (load phases), adds `sent_request_per_s` (requests sent in the
    phase per second) and, with a spec, `goodput_request_per_s`.
    """
    sub = rm.subset(mask)
    ok = sub.is_ok
    n = len(sub)
    out = {
        "n": n,
        "counts": metrics.outcome_counts(sub.status, sub.error_class)["by_status"],
        "error_rate": float((~ok).mean()) if n else None,
        "latency_ms": {
            "ttft": metrics.distribution(sub.ttft_ms[ok]),
            "tpot": metrics.distribution(sub.tpot_ms[ok]),
            "itl": metrics.distribution(sub.pooled_itl_ms(ok)),
            "e2e": metrics.distribution(sub.e2e_ms[ok]),
        },
    }
    if duration_s:
        out["sent_request_per_s"] = n / duration_s
    if spec is not None:
        good = good_mask(sub, spec)
        out["good_requests"] = int(good.sum())
        out["attainment"] = float(good.mean()) if n else None
        if duration_s:
            out["goodput_request_per_s"] = float(good.sum()) / duration_s
    return out


def slices_summary(
    rm: RequestMetrics,
    spec: SLOSpec | None = None,
    *,
    input_edges: tuple[float, ...] = DEFAULT_INPUT_EDGES,
    output_edges: tuple[float, ...] = DEFAULT_OUTPUT_EDGES,
    num_phases: int = DEFAULT_NUM_PHASES,
) -> dict:
    """The `slices` block: `{input_tokens: [...], output_tokens: [...], phase: [...]}`.

    Each entry is `{label, range, ...slice_summary}`; `range` is [low, high) in tokens for
    length buckets (null = open) and [start_s, end_s) from the window start for phases.
    """
    out: dict[str, list] = {}
    for key, values, edges in (
        ("input_tokens", rm.input_tokens, input_edges),
        ("output_tokens", rm.output_tokens, output_edges),
    ):
        out[key] = [
            {"label": label, "range": bounds, **slice_summary(rm, mask, spec, None)}
            for label, mask, bounds in bucket_labels(values, edges)
        ]
    out["phase"] = []
    for label, mask, bounds in phase_masks(rm, num_phases):
        duration_s = bounds[1] - bounds[0] if bounds[0] is not None else None
        out["phase"].append(
            {"label": label, "range": bounds, **slice_summary(rm, mask, spec, duration_s)}
        )
    return out
