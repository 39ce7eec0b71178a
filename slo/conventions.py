"""TPOT and ITL under other tools' definitions, side by side, to reconcile numbers.

Tools disagree on three things: whether a figure is per request (then summarised over
requests) or pooled over every gap; whether the first token (TTFT) is inside it; and how
percentiles are taken. What each tool does, as read in its source (all latencies in ms
here; requests are the ok ones):

vLLM (`vllm/benchmarks/serve.py` `calculate_metrics`, and the clients in
`vllm/benchmarks/lib/endpoint_request_func.py`): TPOT per request with more than one
output token = (latency - ttft) / (output_len - 1); ITL = every gap between consecutive
chunks that carry `choices`, pooled over requests; E2EL = latency. The completions
client times chunks with `choices` (we use token-bearing chunks; a special token with
empty text is one vLLM counts and we may not) and its latency ends at the last of them;
the chat client's first timed chunk is the role-only one and its latency ends at the
last chunk of any kind (the usage chunk), so the endpoint recorded in the manifest picks
the variant. Percentiles: `np.percentile` (linear).

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

import dataclasses
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from slo import metrics
from slo.chunk_digest import ANY, CONTENT, THROUGH_LAST_TOKEN, ChunkDigest, digest_chunks
from slo.frame import RequestMetrics
from slo.runrecord import Endpoint
from slo.sketch import Pooled


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


CHUNK_KINDS = ("token", "content", "any", "through_last_token")


@dataclass(frozen=True, eq=False)
class ChunkView:
    """Per-request first and last chunk times (ns, NaN with none; aligned with the request
    ids asked for) and pooled gaps (ms) over one kind of chunk."""

    first_ns: np.ndarray
    last_ns: np.ndarray
    gaps_ms: np.ndarray  # empty when `pooled` is a sketch
    gaps_by_request: dict  # request_id -> its gaps (ms), as `metrics.itl_ms_by_request`
    pooled: Pooled | None = None  # the gaps pooled: exact, or a sketch over the memory budget


def chunk_view(
    chunks: pa.Table | metrics.ChunkOrder | ChunkDigest,
    request_ids: np.ndarray,
    kind: str,
    *,
    with_gaps: bool = True,
) -> ChunkView:
    """Chunk times over the chunks of `kind`: "token" (n_tokens > 0), "content" (tokens or
    text), "any", or "through_last_token" (every chunk up to a request's last token-bearing
    one: a chat stream's leading role chunk in, a trailing usage-only chunk out). Pass a
    `metrics.ChunkOrder` to reuse one ordering for several kinds. `with_gaps=False` leaves
    the gaps out (empty), for a caller that needs only the first and last times: on a run of
    millions of chunks the gaps are most of the view's memory. A `ChunkDigest` (`summarize`
    reads one within the memory budget) gives the times and the pooled gaps it holds: a
    sketch's view has `pooled` and no gap arrays."""
    if kind not in CHUNK_KINDS:
        raise ValueError(f"kind must be one of {CHUNK_KINDS}")
    if isinstance(chunks, ChunkDigest):
        return _digest_view(chunks, request_ids, kind, with_gaps)
    n_ids = len(request_ids)
    order = metrics.ChunkOrder.of(chunks)
    if len(order) == 0:
        return ChunkView(np.full(n_ids, np.nan), np.full(n_ids, np.nan), np.empty(0), {})
    tokens, codes = order.n_tokens, order.codes
    if kind == "token":
        keep = tokens > 0
    elif kind == "content":
        keep = (tokens > 0) | (order.n_chars > 0)
    elif kind == "any":
        keep = None
    else:
        position = np.arange(len(order))
        last_token = np.full(len(order.names), -1)
        has_tokens = tokens > 0
        np.maximum.at(last_token, codes[has_tokens], position[has_tokens])
        keep = position <= last_token[codes]
        del position
    by_request = order.gaps_by_request(keep) if with_gaps else {}
    gaps = metrics.pooled_itl_ms(by_request, request_ids) if with_gaps else np.empty(0)
    first = np.full(n_ids, np.nan)
    last = np.full(n_ids, np.nan)
    kept_codes = codes if keep is None else codes[keep]
    kept_t = order.t_ns if keep is None else order.t_ns[keep]
    if kept_codes.size:
        starts, ends = metrics.request_runs(kept_codes)
        ends = ends - 1
        # rows are in time order within a request: its first and last kept rows
        index = {order.names[c]: i for i, c in enumerate(kept_codes[starts].tolist())}
        lows, highs = kept_t[starts].astype(float), kept_t[ends].astype(float)
        for i, request_id in enumerate(request_ids):
            j = index.get(request_id)
            if j is not None:
                first[i], last[i] = lows[j], highs[j]
    return ChunkView(first, last, gaps, by_request)


def _digest_view(digest: ChunkDigest, request_ids, kind: str, with_gaps: bool) -> ChunkView:
    first, last = digest.times(kind, request_ids)
    if not with_gaps or kind == ANY:
        return ChunkView(first, last, np.empty(0), {})
    if kind not in digest.pools:  # not kept by this digest's pass
        raise ValueError(f"the chunks' digest keeps no {kind} gaps")
    pooled = digest.pooled(kind, request_ids)
    if not pooled.is_exact:
        return ChunkView(first, last, np.empty(0), {}, pooled)
    return ChunkView(first, last, pooled.values, digest.by_request(kind), pooled)


@dataclass(frozen=True, eq=False)
class VllmMetrics:
    """vLLM's per-request TTFT, TPOT and E2EL (ms, aligned with the ok requests of the
    `RequestMetrics` they came from; NaN = undefined) and its chunk gaps."""

    request_id: np.ndarray
    ttft_ms: np.ndarray
    tpot_ms: np.ndarray
    e2el_ms: np.ndarray
    chunks: ChunkView


def vllm_metrics(
    rm: RequestMetrics,
    chunks: pa.Table | metrics.ChunkOrder,
    endpoint: Endpoint = Endpoint.COMPLETIONS,
) -> VllmMetrics:
    """TTFT, TPOT, E2EL and ITL of the ok requests of `rm` as `vllm bench serve` defines them.

    vLLM times chunks that carry `choices`: for chat that includes the leading role chunk
    and its latency runs to the last chunk of any kind (the usage chunk); for completions
    both end at the last chunk with text. TPOT = (latency - ttft) / (output_len - 1)."""
    ok = rm.is_ok
    ids = rm.request_id[ok]
    sent = rm.t_sent_ns[ok]
    n_out = rm.output_tokens[ok]
    if not isinstance(chunks, ChunkDigest):  # one pass over the chunks, exact
        chunks = digest_chunks(chunks, kinds=(CONTENT, THROUGH_LAST_TOKEN))
    if endpoint == Endpoint.CHAT:
        view = chunk_view(chunks, ids, "through_last_token")
        last_any = chunk_view(chunks, ids, "any", with_gaps=False).last_ns
        end = np.where(np.isnan(last_any), rm.t_done_ns[ok], last_any)
    else:
        view = chunk_view(chunks, ids, "token")
        end = view.last_ns
    ttft = (view.first_ns - sent) / metrics.NS_PER_MS
    latency = (end - sent) / metrics.NS_PER_MS
    tpot = (latency - ttft) / np.where(n_out >= 2, n_out - 1, np.nan)
    return VllmMetrics(ids, ttft, tpot, latency, view)


def conventions_summary(
    rm: RequestMetrics,
    chunks: pa.Table | metrics.ChunkOrder,
    endpoint: Endpoint = Endpoint.COMPLETIONS,
) -> dict:
    """The `conventions` block: per tool (`harness`, `vllm`, `guidellm`, `aiperf`, `mlperf`),
    `{source, percentile_method, metrics: {tool's metric name: {mean, p50, p90, p95, p99,
    max, n, definition}}, throughput: {output_tokens_per_s: {value, definition}}}`, over ok
    requests, latencies in ms."""
    ok = rm.is_ok
    ids = rm.request_id[ok]
    n_out = rm.output_tokens[ok]
    first = rm.t_first_token_ns[ok]
    last_token = rm.t_last_token_ns[ok]
    sent = rm.t_sent_ns[ok]
    done = rm.t_done_ns[ok]
    if not isinstance(chunks, ChunkDigest):  # one pass over the chunks for every kind below
        kinds = (CONTENT, THROUGH_LAST_TOKEN) if endpoint == Endpoint.CHAT else (CONTENT,)
        chunks = digest_chunks(chunks, kinds=kinds)
    any_chunk = chunk_view(chunks, ids, "any", with_gaps=False)
    last_chunk = np.where(np.isnan(any_chunk.last_ns), done, any_chunk.last_ns)
    multi = np.where(n_out >= 2, n_out - 1, np.nan)
    ttft = (first - sent) / metrics.NS_PER_MS
    # The pooled gaps (exact: a float per chunk) are reduced to their distribution as soon as
    # they are taken, so a run of millions of chunks holds one such array at a time.
    itl = metrics.pooled_distribution(rm.pooled_itl(ok))
    vllm = vllm_metrics(rm, chunks, endpoint)
    vllm_itl = metrics.pooled_distribution(vllm.chunks.pooled)
    vllm = dataclasses.replace(vllm, chunks=None)
    inter_chunk = metrics.pooled_distribution(chunks.pooled(CONTENT, ids))
    aiperf_tpot = (last_chunk - first) / metrics.NS_PER_MS / multi
    guidellm_tpot = (last_token - sent) / metrics.NS_PER_MS / np.where(n_out >= 1, n_out, np.nan)
    guidellm_itl = (last_token - first) / metrics.NS_PER_MS / multi
    scheduled = rm.t_scheduled_ns[ok]
    scheduled = np.where(np.isnan(scheduled), sent, scheduled)
    mlperf_tpot = (done - first) / metrics.NS_PER_MS / multi

    linear = "linear interpolation (numpy default)"
    nearest = "nearest rank: sorted[floor(n * p)]"
    weighted = "weighted inverse CDF: first value whose cumulative weight reaches p"
    tokens = float(np.nansum(n_out))
    window_s = rm.window_s()
    per_window = tokens / window_s if window_s else None
    issued_ns = np.fmin(rm.t_scheduled_ns, rm.t_sent_ns)
    mlperf_s = (
        (np.nanmax(rm.t_done_ns) - np.nanmin(issued_ns)) / metrics.NS_PER_S
        if len(rm) and not np.isnan(issued_ns).all() and not np.isnan(rm.t_done_ns).all()
        else None
    )
    throughput = {
        "harness": (per_window, "ok output tokens / (last done - first send)"),
        "vllm": (
            per_window,
            "output tokens of completed requests / benchmark duration "
            "(first request start to last end)",
        ),
        "guidellm": (per_window, "output tokens / (last request end - first request start)"),
        "aiperf": (
            per_window,
            "output_token_throughput: output tokens / benchmark duration "
            "(first request sent to last response)",
        ),
        "mlperf": (
            tokens / mlperf_s if mlperf_s else None,
            "tokens per second: output tokens / (last completion - first query issued)",
        ),
    }
    out = {
        "harness": _convention("slo.metrics (this harness)", linear, {
            "ttft": (_dist(ttft, _linear), "send to first token-bearing chunk"),
            "tpot": (_dist(rm.tpot_ms[ok], _linear),
                     "(last token - first token) / (output_tokens - 1), per request"),
            "itl": (itl, "token-bearing chunk gaps, pooled"),
        }),
        "vllm": _convention(f"vllm/benchmarks/serve.py calculate_metrics ({endpoint})", linear, {
            "ttft": (_dist(vllm.ttft_ms, _linear), "send to the first chunk with choices"),
            "tpot": (_dist(vllm.tpot_ms, _linear),
                     "(latency - ttft) / (output_len - 1), per request"),
            "itl": (vllm_itl,
                    "gaps between chunks with choices, pooled"),
            "e2el": (_dist(vllm.e2el_ms, _linear),
                     "send to the last chunk timed (chat: any chunk; completions: with text)"),
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
            "inter_token_latency": (_dist(aiperf_tpot, _linear),
                                    "(request_latency - ttft) / (output_sequence_length - 1), "
                                    "per request"),
            "inter_chunk_latency": (inter_chunk,
                                    "gaps between consecutive non-empty chunks, pooled"),
        }),
        "mlperf": _convention("mlcommons/inference loadgen", nearest, {
            "ttft": (_dist((first - scheduled) / metrics.NS_PER_MS, nearest_rank_percentile),
                     "scheduled time to first token (includes dispatch lag)"),
            "tpot": (_dist(mlperf_tpot, nearest_rank_percentile),
                     "(latency - first token latency) / (n_tokens - 1), per sample"),
        }),
    }  # fmt: skip
    for tool, (value, definition) in throughput.items():
        out[tool]["throughput"] = {"output_tokens_per_s": {"value": value,
                                                           "definition": definition}}  # fmt: skip
    return out


def _convention(source: str, percentiles: str, entries: dict[str, tuple[dict, str]]) -> dict:
    return {
        "source": source,
        "percentile_method": percentiles,
        "metrics": {name: {**dist, "definition": text} for name, (dist, text) in entries.items()},
    }


def vllm_peaks(vllm: VllmMetrics, sent_ns: np.ndarray) -> tuple[float, int]:
    """(max_output_tokens_per_s, max_concurrent_requests) as `vllm bench serve` computes them.

    Over the ok requests (`sent_ns` aligned with `vllm.request_id`). Tokens: one-second
    buckets from the first send; each timed chunk counts one token in its bucket, and the
    fullest bucket is the figure. Concurrency: the most requests in flight at any instant,
    each in flight over [send, send + E2EL) (a request ending when another starts does not
    overlap it), as vLLM's sweep over start and end events. (0.0, 0) with no ok request."""
    sent_ns = np.asarray(sent_ns, float)
    keep = ~np.isnan(sent_ns) & ~np.isnan(vllm.e2el_ms)
    if not keep.any():
        return 0.0, 0
    start_ns = float(sent_ns[keep].min())
    end_s = (sent_ns[keep] - start_ns) / metrics.NS_PER_S + vllm.e2el_ms[keep] / 1e3
    n_buckets = int(np.ceil(end_s.max())) + 1
    tokens = np.zeros(n_buckets)
    for i in np.flatnonzero(keep):
        first_s = (vllm.chunks.first_ns[i] - start_ns) / metrics.NS_PER_S
        if not np.isnan(first_s):
            gaps_s = vllm.chunks.gaps_by_request.get(vllm.request_id[i], np.empty(0)) / 1e3
            times_s = first_s + np.concatenate(([0.0], np.cumsum(gaps_s)))
            buckets = times_s.astype(int)
            np.add.at(tokens, buckets[(buckets >= 0) & (buckets < n_buckets)], 1)
    begin_ns = sent_ns[keep]
    times = np.concatenate((begin_ns, begin_ns + vllm.e2el_ms[keep] * metrics.NS_PER_MS))
    deltas = np.concatenate((np.ones(begin_ns.size), -np.ones(begin_ns.size)))
    order = np.lexsort((deltas, times))  # by time; at a tie the end (-1) before the start
    return float(tokens.max()), int(np.cumsum(deltas[order]).max())
