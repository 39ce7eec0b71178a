"""What the target's own `/metrics` said during a run: scheduler queues, KV cache, preemptions,
prefix-cache hits and speculative decoding, from `server_metrics.parquet`.

Names are vLLM's (`vllm:*`), which the reference engine uses too; a sample is summed over its
label sets (vLLM labels by model and engine) at each scrape. Gauges are summarised by mean and
max; counters by their increase over the run (a counter that went down, a restart, counts from
its new value). A target with no `/metrics` (llama.cpp's server) gives `available: false`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from slo.runrecord import ServerMetricColumn, float_column, string_column

# (key, sample names in order of preference: vLLM v1, then older spellings)
GAUGES = (
    ("running", ("vllm:num_requests_running",)),
    ("waiting", ("vllm:num_requests_waiting",)),
    ("kv_cache_usage", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
)
COUNTERS = (
    ("preemptions", ("vllm:num_preemptions_total", "vllm:num_preemptions")),
    ("prefix_cache_queries", ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries")),
    ("prefix_cache_hits", ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits")),
    ("spec_decode_drafts", ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts")),
    (
        "spec_decode_draft_tokens",
        ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens"),
    ),
    (
        "spec_decode_accepted_tokens",
        ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens"),
    ),
)
MAX_SERIES_POINTS = 120
NOT_AVAILABLE = "not available: the target exposes no Prometheus /metrics"


def series_by_time(table: pa.Table, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """(t_s, value summed over label sets) for the first of `names` present, or None."""
    name_col = string_column(table, ServerMetricColumn.NAME)
    for name in names:
        rows = name_col == name
        if not np.any(rows):
            continue
        t_ns = float_column(table, ServerMetricColumn.T_NS)[rows]
        values = float_column(table, ServerMetricColumn.VALUE)[rows]
        times, inverse = np.unique(t_ns, return_inverse=True)
        sums = np.zeros(len(times))
        np.add.at(sums, inverse, values)
        return times / 1e9, sums
    return None


def counter_increase(values: np.ndarray) -> float:
    """The increase of a counter sampled as `values` (in time order), counting through resets:
    a drop restarts the count from the new value."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return 0.0
    steps = np.diff(values)
    return float(np.where(steps >= 0, steps, values[1:]).sum())


def _thin(t_s: np.ndarray, values: np.ndarray) -> list[list[float]]:
    step = max(1, int(np.ceil(len(t_s) / MAX_SERIES_POINTS)))
    return [[float(t), float(v)] for t, v in zip(t_s[::step], values[::step], strict=True)]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def server_metrics_summary(table: pa.Table) -> dict:
    """`{available, reason, samples, gauges, counters, prefix_cache_hit_rate,
    spec_decode_acceptance, spec_decode_mean_accepted_length, series}` of a
    `server_metrics.parquet` table.

    `gauges[key]` is `{mean, max, last}` (None for a metric the target does not export);
    `counters[key]` the increase over the run; `prefix_cache_hit_rate` is hits / queries (both
    in tokens, as vLLM counts them) and `spec_decode_acceptance` accepted / draft tokens (None
    when the counters are absent or did not move), `spec_decode_mean_accepted_length` the tokens
    each verify step emitted, 1 + accepted / drafts (vLLM's "mean acceptance length"; None
    likewise); `series[key]` is `[[t_s, value], ...]` for
    each gauge, at most MAX_SERIES_POINTS points, `t_s` from the run's start.
    """
    if table.num_rows == 0:
        return {"available": False, "reason": NOT_AVAILABLE, "samples": 0}
    gauges, series, counters = {}, {}, {}
    for key, names in GAUGES:
        found = series_by_time(table, names)
        if found is None:
            gauges[key] = None
            continue
        t_s, values = found
        gauges[key] = {
            "mean": float(values.mean()),
            "max": float(values.max()),
            "last": float(values[-1]),
        }
        series[key] = _thin(t_s, values)
    for key, names in COUNTERS:
        found = series_by_time(table, names)
        counters[key] = None if found is None else counter_increase(found[1])
    return {
        "available": True,
        "reason": None,
        "samples": table.num_rows,
        "gauges": gauges,
        "counters": counters,
        "prefix_cache_hit_rate": _ratio(
            counters["prefix_cache_hits"], counters["prefix_cache_queries"]
        ),
        "spec_decode_acceptance": _ratio(
            counters["spec_decode_accepted_tokens"], counters["spec_decode_draft_tokens"]
        ),
        "spec_decode_mean_accepted_length": _mean_accepted_length(counters),
        "series": series,
    }


def _mean_accepted_length(counters: dict) -> float | None:
    per_draft = _ratio(counters["spec_decode_accepted_tokens"], counters["spec_decode_drafts"])
    return None if per_draft is None else 1.0 + per_draft
