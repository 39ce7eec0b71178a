"""Slices: metrics and attainment by input-length bucket, output-length bucket, load (the
number of requests in flight when a request was sent) and, as an option, fixed-width time.

Buckets are [low, high) ranges given by ascending edges; the last bucket is open-ended and
labelled "low+". Requests with no recorded count fall in an "unknown" bucket (failed
requests often lack an output count), so no request leaves a denominator. The load slice
says how tail latency grows with what the target was already serving. Time slices (as
AIPerf's `--slice-duration`) cut the dispatch period, first send to last send, into windows
of a fixed width and assign each request by its send time; the drain after the last send is
in none of them, so no slice is empty for want of sends.
"""

from __future__ import annotations

import math

import numpy as np

from slo import metrics
from slo.errors import SLOError
from slo.frame import RequestMetrics
from slo.goodput import good_mask
from slo.spec import SLOSpec

DEFAULT_INPUT_EDGES = (0, 128, 512, 2048, 8192)
DEFAULT_OUTPUT_EDGES = (0, 64, 256, 1024, 4096)
# In-flight count buckets: [0, 1), [1, 2), [2, 4), [4, 8), ... (powers of two)
DEFAULT_IN_FLIGHT_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


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


def in_flight_at_send(t_sent_ns: np.ndarray, t_done_ns: np.ndarray) -> np.ndarray:
    """For each request, how many other requests were in flight when it was sent: sent
    before it and not done by its send time (a request never done stays in flight). NaN for
    a request never sent. O(n log n)."""
    sent = np.asarray(t_sent_ns, float)
    done = np.where(np.isnan(np.asarray(t_done_ns, float)), np.inf, t_done_ns)
    has_sent = ~np.isnan(sent)
    sent_sorted = np.sort(sent[has_sent])
    done_sorted = np.sort(done[has_sent])
    out = np.full(sent.shape, np.nan)
    at = sent[has_sent]
    out[has_sent] = np.searchsorted(sent_sorted, at, "left") - np.searchsorted(
        done_sorted, at, "right"
    )
    return out


def time_slice_masks(
    rm: RequestMetrics, slice_duration_s: float
) -> list[tuple[str, np.ndarray, list]]:
    """(label, mask, [start_s, end_s]) per fixed-width time slice of the dispatch period
    (first send to last send; the drain after the last send is no slice), each request in
    the slice of its send time; the last slice ends at the last send (it may be shorter)."""
    if not slice_duration_s > 0 or math.isinf(slice_duration_s):
        raise SLOError(
            f"the time slice duration must be a positive number of seconds, not {slice_duration_s!r}."
        )
    sent = rm.t_sent_ns
    if np.isnan(sent).all():
        return []
    start_ns = float(np.nanmin(sent))
    offsets_s = (sent - start_ns) / metrics.NS_PER_S
    span_s = float(np.nanmax(offsets_s))
    n_slices = max(1, math.ceil(span_s / slice_duration_s - 1e-9))
    index = np.minimum(np.floor(offsets_s / slice_duration_s), n_slices - 1)
    out = []
    for i in range(n_slices):
        low = i * slice_duration_s
        high = (
            min((i + 1) * slice_duration_s, span_s) if i == n_slices - 1 else low + slice_duration_s
        )
        out.append((f"{low:g}-{high:g} s", index == i, [low, high]))
    return out


def slice_summary(
    rm: RequestMetrics, mask: np.ndarray, spec: SLOSpec | None, duration_s: float | None
) -> dict:
    """Counts, error rate, latency distributions and (with a spec) attainment for a slice.

    With `duration_s` (time slices), adds `sent_request_per_s` (requests sent in the
    slice per second) and, with a spec, `goodput_request_per_s`.
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
            "itl": metrics.pooled_distribution(sub.pooled_itl(ok)),
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
    in_flight_edges: tuple[float, ...] = DEFAULT_IN_FLIGHT_EDGES,
    slice_duration_s: float | None = None,
) -> dict:
    """The `slices` block: `{input_tokens: [...], output_tokens: [...], in_flight: [...]}`,
    and `time: [...]` with `slice_duration_s`.

    Each entry is `{label, range, ...slice_summary}`; `range` is [low, high) in tokens for
    length buckets, in requests for the in-flight count at dispatch (null = open), and
    [start_s, end_s) from the first send for time slices.
    """
    out: dict[str, list] = {}
    for key, values, edges in (
        ("input_tokens", rm.input_tokens, input_edges),
        ("output_tokens", rm.output_tokens, output_edges),
        ("in_flight", in_flight_at_send(rm.t_sent_ns, rm.t_done_ns), in_flight_edges),
    ):
        out[key] = [
            {"label": label, "range": bounds, **slice_summary(rm, mask, spec, None)}
            for label, mask, bounds in bucket_labels(values, edges)
        ]
    if slice_duration_s is not None:
        out["time"] = []
        for label, mask, bounds in time_slice_masks(rm, slice_duration_s):
            duration_s = bounds[1] - bounds[0]
            out["time"].append(
                {"label": label, "range": bounds, **slice_summary(rm, mask, spec, duration_s)}
            )
    return out
