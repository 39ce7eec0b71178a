"""Output correctness: each output against the reference engine's output for the same prompt run
alone (batch 1, greedy), and the MLPerf TEST06-style flags, summarised over a run.

Numerics legitimately change greedy outputs at large batch (a different reduction order flips
a near-tie), so the summary gives rates by load level, not only a verdict.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from slo.runrecord import OutputFlag, RequestColumn, RequestStatus, float_column, string_column

# The flags that make an ok request's output wrong (`output_valid` false).
WRONG_FLAGS = frozenset(
    {
        OutputFlag.DIVERGED,
        OutputFlag.SHORT_IGNORE_EOS,
        OutputFlag.CONSTRAINT_VIOLATED,
        OutputFlag.TOOL_CALL_INVALID,
    }
)
# In-flight requests at send time (this one included), as bucket upper bounds.
LOAD_EDGES = (1, 2, 4, 8, 16, 32, 64)


def compare_tokens(
    reference: Sequence[int], output: Sequence[int]
) -> tuple[bool, int | None, float]:
    """`(exact, first_divergence, agreement)` of `output` against `reference`.

    `first_divergence` is the first index where they differ, counting a missing token as a
    difference (`min(len)` when one is a prefix of the other), None when they are equal;
    `agreement` is the number of positions holding the same token over the longer length
    (1.0 for two empty outputs)."""
    ref, out = list(reference), list(output)
    longest = max(len(ref), len(out))
    if longest == 0:
        return True, None, 1.0
    same = [a == b for a, b in zip(ref, out, strict=False)]
    first = next((i for i, s in enumerate(same) if not s), None)
    if first is None and len(ref) != len(out):
        first = len(same)
    return first is None, first, sum(same) / longest


def in_flight_at_send(t_sent_ns: np.ndarray, t_done_ns: np.ndarray) -> np.ndarray:
    """For each request, how many requests (itself included) were in flight when it was sent:
    those sent at or before it and not done before it. NaN for a request never sent."""
    sent = np.asarray(t_sent_ns, dtype=np.float64)
    done = np.asarray(t_done_ns, dtype=np.float64)
    done = np.where(np.isnan(done), np.inf, done)
    out = np.full(len(sent), np.nan)
    valid = ~np.isnan(sent)
    for i in np.flatnonzero(valid):
        out[i] = np.count_nonzero(valid & (sent <= sent[i]) & (done > sent[i]))
    return out


def _bucket(n: float) -> str:
    low = 1
    for edge in LOAD_EDGES:
        if n <= edge:
            return str(edge) if low == edge else f"{low}-{edge}"
        low = edge + 1
    return f">{LOAD_EDGES[-1]}"


def server_running_at(t_ns: np.ndarray, server_metrics: pa.Table | None) -> np.ndarray:
    """The server's running requests (its batch, `vllm:num_requests_running`) at the last
    scrape at or before each time; NaN before the first scrape or without the metric."""
    from slo.server_metrics import GAUGES, series_by_time

    t = np.asarray(t_ns, dtype=np.float64)
    found = (
        None if server_metrics is None else series_by_time(server_metrics, dict(GAUGES)["running"])
    )
    if found is None:
        return np.full(len(t), np.nan)
    t_s, values = found
    index = np.searchsorted(t_s * 1e9, np.nan_to_num(t, nan=-np.inf), side="right") - 1
    out = np.where(index >= 0, values[np.clip(index, 0, None)], np.nan)
    return np.where(np.isnan(t), np.nan, out)


def _rates_by(labels: np.ndarray, compared: np.ndarray, exact, wrong, key: str) -> list[dict]:
    rows = []
    for label in dict.fromkeys(_bucket(e) for e in (*LOAD_EDGES, LOAD_EDGES[-1] + 1)):
        chosen = compared & (labels == label)
        if np.any(chosen):
            rows.append(
                {
                    key: label,
                    "n": int(np.count_nonzero(chosen)),
                    "exact_rate": float(exact[chosen].mean()),
                    "wrong_rate": float(wrong[chosen].mean()),
                }
            )
    return rows


def _labels(values: np.ndarray) -> np.ndarray:
    # a batch of 0 (scraped before the request arrived) counts as 1: the request itself
    return np.array([_bucket(max(x, 1)) if not np.isnan(x) else None for x in values], dtype=object)


def _flags(requests: pa.Table) -> list[set[str]]:
    return [
        set(f.split(",")) if f else set()
        for f in string_column(requests, RequestColumn.OUTPUT_FLAGS)
    ]


def correctness_summary(
    requests: pa.Table,
    *,
    diverge_before: int | None = None,
    server_metrics: pa.Table | None = None,
) -> dict | None:
    """`{n_compared, n_exact, exact_rate, agreement_mean, n_wrong, diverge_before, flags,
    by_load, by_server_batch, tool_answers_checked, tool_calls_made}` over a contract requests table, or
    None when no request was checked. `tool_answers_checked` counts the ok answers whose tool calls
    were checked (the request offered tools), `tool_calls_made` their calls (None: no tools).

    `flags` counts each OutputFlag; `by_load` lists, per bucket of in-flight requests at send
    time, `{load, n, exact_rate, wrong_rate}` over the compared requests; `by_server_batch` the
    same per bucket of the server's running requests at the last scrape before the send
    (`[]` without server metrics). `diverge_before` is the position recorded with the run (a
    divergence before it made the request `wrong`).
    """
    exact = float_column(requests, RequestColumn.OUTPUT_EXACT_MATCH)
    flags = _flags(requests)
    compared = ~np.isnan(exact)
    # tool calls are checked on the ok answers of requests that offered tools (count not null)
    ok = string_column(requests, RequestColumn.STATUS) == RequestStatus.OK.value
    calls = float_column(requests, RequestColumn.NUM_TOOL_CALLS)[ok]
    tool_answers = int(np.count_nonzero(~np.isnan(calls)))
    if not np.any(compared) and not any(flags) and not tool_answers:
        return None
    agreement = float_column(requests, RequestColumn.OUTPUT_AGREEMENT)
    wrong = np.array([OutputFlag.DIVERGED in f for f in flags], dtype=bool)
    load = in_flight_at_send(
        float_column(requests, RequestColumn.T_SENT_NS),
        float_column(requests, RequestColumn.T_DONE_NS),
    )
    n = int(np.count_nonzero(compared))
    exact_ok = np.nan_to_num(exact)
    batch = server_running_at(float_column(requests, RequestColumn.T_SENT_NS), server_metrics)
    return {
        "n_compared": n,
        "n_exact": int(np.nansum(exact[compared])) if n else 0,
        "exact_rate": float(exact[compared].mean()) if n else None,
        "agreement_mean": float(np.nanmean(agreement[compared])) if n else None,
        "n_wrong": int(np.count_nonzero(wrong)),
        "diverge_before": diverge_before,
        "flags": {flag.value: sum(flag.value in f for f in flags) for flag in OutputFlag},
        "by_load": _rates_by(_labels(load), compared, exact_ok, wrong, "load"),
        "by_server_batch": _rates_by(_labels(batch), compared, exact_ok, wrong, "batch"),
        "tool_answers_checked": tool_answers if tool_answers else None,
        "tool_calls_made": int(np.nansum(calls)) if tool_answers else None,
    }
