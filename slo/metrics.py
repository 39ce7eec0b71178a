"""Metric definitions: pure functions over numpy arrays and pyarrow tables.

Every time input is nanoseconds relative to the run's `t0_ns` (float64 with NaN where the
event never happened, as `slo.runrecord.float_column` returns them); every latency output
is milliseconds. "Undefined" is NaN in arrays and None in summaries, never 0.

Percentiles use linear interpolation between order statistics (numpy's default
`method="linear"`, which vLLM's `benchmarks/serve` uses too): for sorted values x[0..n-1],
the q-th percentile is x[h] interpolated at h = (n - 1) * q / 100.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from slo.runrecord import ChunkColumn, RequestStatus

NS_PER_MS = 1e6
NS_PER_S = 1e9
PERCENTILES = (50, 90, 95, 99)
STATUSES = tuple(s.value for s in RequestStatus if s.attempted)  # of requests that were sent


def ttft_ms(t_sent_ns: np.ndarray, t_first_token_ns: np.ndarray) -> np.ndarray:
    """Time to first token: send to the first token-bearing chunk, per request, in ms.

    NaN where either time is missing (the request never sent, or never got a token).
    """
    return (np.asarray(t_first_token_ns, float) - np.asarray(t_sent_ns, float)) / NS_PER_MS


def tpot_ms(
    t_first_token_ns: np.ndarray, t_last_token_ns: np.ndarray, output_tokens: np.ndarray
) -> np.ndarray:
    """Time per output token after the first, per request, in ms.

    (t_last_token - t_first_token) / (output_tokens - 1). Undefined (NaN, never 0) when the
    request produced fewer than two output tokens, or when a time or the count is missing.
    """
    first = np.asarray(t_first_token_ns, float)
    last = np.asarray(t_last_token_ns, float)
    tokens = np.asarray(output_tokens, float)
    decode_tokens = np.where(tokens >= 2, tokens - 1, np.nan)
    return (last - first) / NS_PER_MS / decode_tokens


def e2e_ms(t_sent_ns: np.ndarray, t_done_ns: np.ndarray) -> np.ndarray:
    """End-to-end latency: send to done (response fully received or failed), per request, in ms.

    NaN where either time is missing.
    """
    return (np.asarray(t_done_ns, float) - np.asarray(t_sent_ns, float)) / NS_PER_MS


def dispatch_lag_ms(t_scheduled_ns: np.ndarray, t_sent_ns: np.ndarray) -> np.ndarray:
    """How late the client sent each request: t_sent - t_scheduled, in ms (NaN where missing).

    A large lag means the load generator, not the target, limited the offered load.
    """
    return (np.asarray(t_sent_ns, float) - np.asarray(t_scheduled_ns, float)) / NS_PER_MS


def itl_ms_by_request(chunks: pa.Table) -> dict[str, np.ndarray]:
    """Inter-token latencies per request, in ms: gaps between consecutive token-bearing chunks.

    Only chunks with `n_tokens > 0` count (role-only and usage-only chunks are skipped). A
    chunk carrying k tokens is one gap, not k: this measures what a user sees stream in. A
    request with fewer than two token-bearing chunks maps to an empty array; requests with no
    token-bearing chunk at all are absent from the result.
    """
    if chunks.num_rows == 0:
        return {}
    token_chunks = chunks.filter(pc.fill_null(pc.greater(chunks[ChunkColumn.N_TOKENS], 0), False))
    token_chunks = token_chunks.sort_by(
        [(ChunkColumn.REQUEST_ID.value, "ascending"), (ChunkColumn.T_NS.value, "ascending")]
    )
    n = token_chunks.num_rows
    if n == 0:
        return {}
    ids = token_chunks[ChunkColumn.REQUEST_ID].combine_chunks()
    times = np.asarray(
        pc.cast(token_chunks[ChunkColumn.T_NS], pa.float64()).to_numpy(zero_copy_only=False), float
    )
    changed = pc.fill_null(pc.not_equal(ids.slice(1), ids.slice(0, n - 1)), True)
    boundaries = np.flatnonzero(np.asarray(changed.to_numpy(zero_copy_only=False), bool)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [n]))
    names = ids.take(pa.array(starts)).to_pylist()
    gaps_ms = np.diff(times) / NS_PER_MS  # gaps_ms[i] = times[i + 1] - times[i]
    return {name: gaps_ms[s : e - 1] for name, s, e in zip(names, starts, ends, strict=True)}


def pooled_itl_ms(itl_by_request: dict[str, np.ndarray], request_ids: Iterable[str]) -> np.ndarray:
    """All gaps of the given requests in one array (ms); the pooled ITL distribution."""
    arrays = [itl_by_request[r] for r in request_ids if r in itl_by_request]
    return np.concatenate(arrays) if arrays else np.empty(0)


def per_request_itl_ms(
    itl_by_request: dict[str, np.ndarray], request_ids: Sequence[str], reduce: str
) -> np.ndarray:
    """One ITL figure per request in `request_ids` order: `reduce` is "mean" or "max" (ms).

    "max" is the longest stall a user saw. NaN for a request with no gap (fewer than two
    token-bearing chunks).
    """
    if reduce not in ("mean", "max"):
        raise ValueError(f"reduce must be 'mean' or 'max', not {reduce!r}")
    out = np.full(len(request_ids), np.nan)
    for i, request_id in enumerate(request_ids):
        gaps = itl_by_request.get(request_id)
        if gaps is not None and gaps.size:
            out[i] = gaps.mean() if reduce == "mean" else gaps.max()
    return out


def percentile(values: np.ndarray, q: float) -> float | None:
    """The q-th percentile (0..100) of the defined (non-NaN) values, linear interpolation.

    None when no value is defined.
    """
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return None
    return float(np.percentile(values, q, method="linear"))


def distribution(values: np.ndarray) -> dict:
    """`{mean, p50, p90, p95, p99, max, n}` over the defined (non-NaN) values.

    `n` counts the defined values; with n == 0 every statistic is None.
    """
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    out: dict = {"mean": None}
    out.update({f"p{q}": None for q in PERCENTILES})
    out.update({"max": None, "n": int(values.size)})
    if values.size:
        out["mean"] = float(values.mean())
        for q, v in zip(
            PERCENTILES, np.percentile(values, PERCENTILES, method="linear"), strict=True
        ):
            out[f"p{q}"] = float(v)
        out["max"] = float(values.max())
    return out


def measured_window_s(t_sent_ns: np.ndarray, t_done_ns: np.ndarray) -> float | None:
    """The measured window in seconds: first send to last done, over all requests.

    None when no request was sent or none finished, or when the window is not positive.
    """
    sent = np.asarray(t_sent_ns, float)
    done = np.asarray(t_done_ns, float)
    if np.all(np.isnan(sent)) or np.all(np.isnan(done)):
        return None
    window_s = (np.nanmax(done) - np.nanmin(sent)) / NS_PER_S
    return float(window_s) if window_s > 0 else None


def throughput(
    *,
    window_s: float | None,
    num_ok: int,
    num_requests: int,
    ok_input_tokens: float,
    ok_output_tokens: float,
) -> dict:
    """Request and token rates over the measured window, per second.

    `request_per_s`: requests that finished ok; `attempted_request_per_s`: all requests;
    token rates count the input and output tokens of ok requests only. All None when the
    window is undefined.
    """
    keys = (
        "request_per_s",
        "attempted_request_per_s",
        "input_tokens_per_s",
        "output_tokens_per_s",
        "total_tokens_per_s",
    )
    if not window_s:
        return dict.fromkeys(keys)
    values = (
        num_ok,
        num_requests,
        ok_input_tokens,
        ok_output_tokens,
        ok_input_tokens + ok_output_tokens,
    )
    return {k: float(v) / window_s for k, v in zip(keys, values, strict=True)}


def outcome_counts(status: np.ndarray, error_class: np.ndarray) -> dict:
    """`{total, by_status, by_error_class}`; every contract status appears (0 when absent).

    A null status counts as "unknown"; requests without an error class are not in
    `by_error_class`.
    """
    by_status = dict.fromkeys(STATUSES, 0)
    for s in status:
        key = s if s is not None else RequestStatus.UNKNOWN.value
        by_status[key] = by_status.get(key, 0) + 1
    by_error_class: dict[str, int] = {}
    for e in error_class:
        if e is not None:
            by_error_class[e] = by_error_class.get(e, 0) + 1
    return {
        "total": int(len(status)),
        "by_status": by_status,
        "by_error_class": dict(sorted(by_error_class.items())),
    }
