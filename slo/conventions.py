"""TPOT and ITL under other tools' definitions, side by side, to reconcile numbers.

Tools disagree on three things: whether a figure is per request (then summarised over
requests) or pooled over every gap; whether the first token (TTFT) is inside it; and how
percentiles are taken. What each tool does, as read in its source (all latencies in ms
here; requests are the ok ones):

vLLM (`vllm/benchmarks/serve.py`, `calculate_metrics`): TPOT per request with more than
one output token = (latency - ttft) / (output_len - 1), where latency ends at the last
received chunk; ITL = every gap between consecutive streamed chunks, pooled over
requests; E2EL = latency. Percentiles: `np.percentile` (linear). We map "chunk" to a
token-bearing chunk; vLLM's chat client may also time a role-only first chunk (unsure).

GuideLLM (`guidellm` request stats `time_per_output_token_ms`, `inter_token_latency_ms`,
and `DistributionSummary.from_distribution_function`): TPOT per request = (last token
time - request start) / output_tokens, TTFT included; ITL per request = (last token -
first token) / (output_tokens - 1). The benchmark summaries weight each request's TPOT
by its output tokens and ITL by output_tokens - 1, and take a percentile as the first
value whose cumulative weight reaches the fraction (no interpolation). Older releases
(0.1-0.2) used (last - first token) / output_tokens for TPOT and the newest sources drop
the weights; we follow the weighted, TTFT-inclusive form (unsure which release users run).

AIPerf / GenAI-Perf (NVIDIA `aiperf` docs/metrics_reference.md and its
`InterTokenLatencyMetric`): "inter_token_latency" per request = (request_latency - ttft)
/ (output_sequence_length - 1), request_latency ending at the last response chunk, i.e.
what vLLM calls TPOT; "inter_chunk_latency" = gaps between consecutive response chunks.
We pool the chunk gaps over requests and use linear percentiles (unsure how AIPerf pools
ICL for its summary).

MLPerf loadgen (`loadgen/logging.cc` RecordSampleCompletion, `results.cc`): latencies run
from the query's scheduled time, so TTFT includes dispatch lag; TPOT per sample =
(latency - first_token_latency) / (n_tokens - 1), i.e. (done - first token) / (n - 1);
one-token samples are an error there and are left out here. Percentile = sorted[floor(n *
p)] (nearest rank, no interpolation). No ITL.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from slo import metrics
from slo.frame import RequestMetrics


def nearest_rank_percentile(values: np.ndarray, q: float) -> float | None:
    """MLPerf loadgen's percentile: sorted[floor(n * q / 100)], clamped to the last index."""
    values = np.sort(np.asarray(values, float)[~np.isnan(values)])
    if values.size == 0:
        return None
    return float(values[min(int(values.size * q / 100), values.size - 1)])


def weighted_inverse_cdf_percentile(
    values: np.ndarray, weights: np.ndarray, q: float
) -> float | None:
    """GuideLLM's weighted percentile: the first sorted value whose normalised cumulative
    weight reaches q / 100. None when nothing is defined or all weights are zero."""
    values = np.asarray(values, float)
    weights = np.asarray(weights, float)
    keep = ~np.isnan(values) & ~np.isnan(weights) & (weights > 0)
    values, weights = values[keep], weights[keep]
    if values.size == 0:
        return None
    order = np.argsort(values, kind="stable")
    cdf = np.cumsum(weights[order]) / weights.sum()
    index = int(np.argmax(cdf >= q / 100 - 1e-12))
    return float(values[order][index])


def _dist(values: np.ndarray, percentile_fn) -> dict:
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    out: dict = {"mean": float(values.mean()) if values.size else None}
    out.update({f"p{q}": percentile_fn(values, q) for q in metrics.PERCENTILES})
    out["max"] = float(values.max()) if values.size else None
    out["n"] = int(values.size)
    return out


def _linear(values: np.ndarray, q: float) -> float | None:
    return metrics.percentile(values, q)


def _weighted_dist(values: np.ndarray, weights: np.ndarray) -> dict:
    values = np.asarray(values, float)
    weights = np.asarray(weights, float)
    keep = ~np.isnan(values) & ~np.isnan(weights) & (weights > 0)
    v, w = values[keep], weights[keep]
    out: dict = {"mean": float(np.sum(v * w) / w.sum()) if v.size else None}
    out.update({f"p{q}": weighted_inverse_cdf_percentile(v, w, q) for q in metrics.PERCENTILES})
    out["max"] = float(v.max()) if v.size else None
    out["n"] = int(v.size)
    return out


def last_chunk_ns(chunks: pa.Table, request_ids: np.ndarray) -> np.ndarray:
    """Arrival time (ns) of each request's last chunk of any kind; NaN with no chunks."""
    out = np.full(len(request_ids), np.nan)
    if chunks.num_rows == 0:
        return out
    grouped = chunks.group_by("request_id").aggregate([("t_ns", "max")])
    last = dict(
        zip(grouped["request_id"].to_pylist(), grouped["t_ns_max"].to_pylist(), strict=True)
    )
    for i, request_id in enumerate(request_ids):
        value = last.get(request_id)
        if value is not None:
            out[i] = float(value)
    return out


def content_chunk_gaps_ms(chunks: pa.Table, request_ids: np.ndarray) -> np.ndarray:
    """Gaps (ms) between consecutive chunks carrying tokens or text, pooled over requests."""
    if chunks.num_rows == 0:
        return np.empty(0)
    has_content = pc.or_(
        pc.fill_null(pc.greater(chunks["n_tokens"], 0), False),
        pc.fill_null(pc.greater(chunks["n_chars"], 0), False),
    )
    content = chunks.filter(has_content)
    # reuse the token-chunk gap function by marking every content chunk as token-bearing
    marked = content.set_column(
        content.schema.get_field_index("n_tokens"),
        "n_tokens",
        pa.array(np.ones(content.num_rows, np.int32)),
    )
    return metrics.pooled_itl_ms(metrics.itl_ms_by_request(marked), request_ids)


def conventions_summary(rm: RequestMetrics, chunks: pa.Table) -> dict:
    """The `conventions` block: per tool (`harness`, `vllm`, `guidellm`, `aiperf`, `mlperf`),
    `{source, percentile_method, metrics: {tool's metric name: {mean, p50, p90, p95, p99,
    max, n, definition}}}`, over ok requests, in ms."""
    ok = rm.is_ok
    ids = rm.request_id[ok]
    n_out = rm.output_tokens[ok]
    first = rm.t_first_token_ns[ok]
    last_token = rm.t_last_token_ns[ok]
    sent = rm.t_sent_ns[ok]
    done = rm.t_done_ns[ok]
    last_chunk = last_chunk_ns(chunks, ids)
    last_chunk = np.where(np.isnan(last_chunk), done, last_chunk)
    multi = np.where(n_out >= 2, n_out - 1, np.nan)
    ttft = (first - sent) / metrics.NS_PER_MS
    pooled_itl = rm.pooled_itl_ms(ok)

    vllm_tpot = (last_chunk - first) / metrics.NS_PER_MS / multi
    guidellm_tpot = (last_token - sent) / metrics.NS_PER_MS / np.where(n_out >= 1, n_out, np.nan)
    guidellm_itl = (last_token - first) / metrics.NS_PER_MS / multi
    scheduled = rm.t_scheduled_ns[ok]
    scheduled = np.where(np.isnan(scheduled), sent, scheduled)
    mlperf_tpot = (done - first) / metrics.NS_PER_MS / multi

    linear = "linear interpolation (numpy default)"
    nearest = "nearest rank: sorted[floor(n * p)]"
    weighted = "weighted inverse CDF: first value whose cumulative weight reaches p"
    return {
        "harness": _convention("slo.metrics (this harness)", linear, {
            "ttft": (_dist(ttft, _linear), "send to first token-bearing chunk"),
            "tpot": (_dist(rm.tpot_ms[ok], _linear),
                     "(last token - first token) / (output_tokens - 1), per request"),
            "itl": (_dist(pooled_itl, _linear), "token-bearing chunk gaps, pooled"),
        }),
        "vllm": _convention("vllm/benchmarks/serve.py calculate_metrics", linear, {
            "ttft": (_dist(ttft, _linear), "send to first streamed chunk"),
            "tpot": (_dist(vllm_tpot, _linear),
                     "(latency - ttft) / (output_len - 1), per request, latency to the last chunk"),
            "itl": (_dist(pooled_itl, _linear), "gaps between streamed chunks, pooled"),
            "e2el": (_dist((last_chunk - sent) / metrics.NS_PER_MS, _linear),
                     "send to the last chunk"),
        }),
        "guidellm": _convention("guidellm request stats and DistributionSummary", weighted, {
            "time_to_first_token_ms": (_dist(ttft, _linear), "request start to first token"),
            "time_per_output_token_ms": (_weighted_dist(guidellm_tpot, n_out),
                                         "(last token - request start) / output_tokens, "
                                         "TTFT included, weighted by output_tokens"),
            "inter_token_latency_ms": (_weighted_dist(guidellm_itl, n_out - 1),
                                       "(last token - first token) / (output_tokens - 1), "
                                       "weighted by output_tokens - 1"),
        }),
        "aiperf": _convention("aiperf docs/metrics_reference.md", linear, {
            "time_to_first_token": (_dist(ttft, _linear), "request start to first response"),
            "inter_token_latency": (_dist(vllm_tpot, _linear),
                                    "(request_latency - ttft) / (output_sequence_length - 1), "
                                    "per request"),
            "inter_chunk_latency": (_dist(content_chunk_gaps_ms(chunks, ids), _linear),
                                    "gaps between consecutive non-empty chunks, pooled"),
        }),
        "mlperf": _convention("mlcommons/inference loadgen", nearest, {
            "ttft": (_dist((first - scheduled) / metrics.NS_PER_MS, nearest_rank_percentile),
                     "scheduled time to first token (includes dispatch lag)"),
            "tpot": (_dist(mlperf_tpot, nearest_rank_percentile),
                     "(latency - first token latency) / (n_tokens - 1), per sample"),
        }),
    }  # fmt: skip


def _convention(source: str, percentiles: str, entries: dict[str, tuple[dict, str]]) -> dict:
    return {
        "source": source,
        "percentile_method": percentiles,
        "metrics": {name: {**dist, "definition": text} for name, (dist, text) in entries.items()},
    }
