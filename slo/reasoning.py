"""Reasoning models: the `reasoning` block of the summary, and the TTFT an SLO judges.

A reasoning model thinks before it answers, so "time to first token" has two readings. vLLM's
(and this project's default, `ttft: first_token` in the SLO spec) ends at the first token of
either kind; `ttft: first_answer_token` ends at the first answer token, which is when a user of
a chat interface that hides the thinking sees something. `slo_request_metrics` hands the
verdicts and goodput the TTFT the spec names; the latency block always reports the first token.

The block (None when no request had a reasoning token, so a run without reasoning has none),
over ok requests, from requests.parquet's reasoning columns (`harness.load.reasoning_records`):
- `ttft_reasoning_ms`: send to first reasoning token, over the requests that had one;
- `ttft_answer_ms`: send to first answer token;
- `tpot_reasoning_ms`: (last - first reasoning token) / (reasoning tokens - 1), requests with two
  or more reasoning tokens; `tpot_answer_ms`: (last token - first answer token) / (answer
  tokens - 1), requests with two or more answer tokens whose last token is an answer token;
- `reasoning_tokens`, `answer_tokens`, and `usage_reasoning_tokens` (the server's count, where it
  reports one);
- `slo_ttft`: the TTFT the run's SLO judged (None: no SLO).
Each SLO objective that reads TTFT says which one (`ttft`), and so does the `slo` block, in a
run with reasoning or under a spec that asks for the first answer token.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from slo import metrics
from slo.frame import RequestMetrics, attempted_requests
from slo.runrecord import RequestColumn, RequestStatus, float_column, string_column
from slo.spec import FIRST_ANSWER_TOKEN, FIRST_TOKEN, SLOSpec

NS_PER_MS = 1e6
DEFINITIONS = {
    FIRST_TOKEN: "send to the first token of either kind, reasoning or answer (as vLLM)",
    FIRST_ANSWER_TOKEN: "send to the first answer token, after any reasoning",
}


def _columns(requests: pa.Table) -> dict[str, np.ndarray]:
    rows = attempted_requests(requests)  # the rows of RequestMetrics, in its order
    names = (
        RequestColumn.T_SENT_NS,
        RequestColumn.T_FIRST_TOKEN_NS,
        RequestColumn.T_LAST_TOKEN_NS,
        RequestColumn.T_FIRST_REASONING_TOKEN_NS,
        RequestColumn.T_LAST_REASONING_TOKEN_NS,
        RequestColumn.T_FIRST_ANSWER_TOKEN_NS,
        RequestColumn.OUTPUT_REASONING_TOKENS,
        RequestColumn.OUTPUT_ANSWER_TOKENS,
        RequestColumn.USAGE_REASONING_TOKENS,
    )
    out = {str(name): float_column(rows, name) for name in names}
    out["ok"] = string_column(rows, RequestColumn.STATUS) == RequestStatus.OK.value
    out["has_answer_column"] = RequestColumn.T_FIRST_ANSWER_TOKEN_NS in rows.column_names
    return out


def answer_ttft_ms(requests: pa.Table) -> np.ndarray:
    """Send to first answer token (ms) per sent request, NaN where undefined; a run written
    before the column existed had no reasoning split, so its first token stands in."""
    c = _columns(requests)
    first = c[RequestColumn.T_FIRST_ANSWER_TOKEN_NS]
    if not c["has_answer_column"]:
        first = c[RequestColumn.T_FIRST_TOKEN_NS]
    return metrics.ttft_ms(c[RequestColumn.T_SENT_NS], first)


def slo_request_metrics(rm: RequestMetrics, requests: pa.Table, spec: SLOSpec) -> RequestMetrics:
    """`rm` with the TTFT `spec.ttft` names (unchanged for `first_token`)."""
    if spec.ttft != FIRST_ANSWER_TOKEN:
        return rm
    return dataclasses.replace(rm, ttft_ms=answer_ttft_ms(requests))


def had_reasoning(requests: pa.Table) -> bool:
    """Whether any sent request had a reasoning token."""
    c = _columns(requests)
    tokens = np.nan_to_num(c[RequestColumn.OUTPUT_REASONING_TOKENS], nan=0.0)
    return bool(
        (tokens > 0).any() or (~np.isnan(c[RequestColumn.T_FIRST_REASONING_TOKEN_NS])).any()
    )


def _per_token_ms(first: np.ndarray, last: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        values = (last - first) / NS_PER_MS / (tokens - 1)
    return np.where(tokens >= 2, values, np.nan)


def reasoning_summary(requests: pa.Table, spec: SLOSpec | None) -> dict | None:
    """The `reasoning` block (module doc); None when no request had a reasoning token."""
    if not had_reasoning(requests):
        return None
    c = _columns(requests)
    ok = c["ok"]
    sent = c[RequestColumn.T_SENT_NS]
    first_reasoning = c[RequestColumn.T_FIRST_REASONING_TOKEN_NS]
    last_reasoning = c[RequestColumn.T_LAST_REASONING_TOKEN_NS]
    first_answer = c[RequestColumn.T_FIRST_ANSWER_TOKEN_NS]
    last_token = c[RequestColumn.T_LAST_TOKEN_NS]
    reasoning = c[RequestColumn.OUTPUT_REASONING_TOKENS]
    answer = c[RequestColumn.OUTPUT_ANSWER_TOKENS]
    answer_last = np.isnan(last_reasoning) | (last_token > last_reasoning)
    tpot_answer = _per_token_ms(first_answer, last_token, answer)
    with_reasoning = ok & (np.nan_to_num(reasoning, nan=0.0) > 0)
    return {
        "requests_with_reasoning": int(with_reasoning.sum()),
        "ttft_reasoning_ms": metrics.distribution(metrics.ttft_ms(sent, first_reasoning)[ok]),
        "ttft_answer_ms": metrics.distribution(metrics.ttft_ms(sent, first_answer)[ok]),
        "tpot_reasoning_ms": metrics.distribution(
            _per_token_ms(first_reasoning, last_reasoning, reasoning)[ok]
        ),
        "tpot_answer_ms": metrics.distribution(np.where(answer_last, tpot_answer, np.nan)[ok]),
        "reasoning_tokens_per_request": metrics.distribution(reasoning[ok]),
        "answer_tokens_per_request": metrics.distribution(answer[ok]),
        "server_reasoning_tokens_per_request": metrics.distribution(
            c[RequestColumn.USAGE_REASONING_TOKENS][ok]
        ),
        "slo_ttft": spec.ttft if spec is not None else None,
        "definitions": {
            "ttft_reasoning_ms": "send to the first reasoning token",
            "ttft_answer_ms": "send to the first answer token",
            "tpot_reasoning_ms": "(last - first reasoning token) / (reasoning tokens - 1)",
            "tpot_answer_ms": "(last token - first answer token) / (answer tokens - 1)",
            "slo_ttft": DEFINITIONS[spec.ttft] if spec is not None else None,
        },
    }


def _reads_ttft(objective: dict, spec: SLOSpec) -> bool:
    if objective.get("kind") == "percentile":
        return objective.get("metric") == "ttft_ms"
    if objective.get("kind") == "attainment":
        limits = [spec.per_request.ttft_ms, *(s.per_request.ttft_ms for s in spec.slices)]
        return any(limit is not None for limit in limits)
    return False


def mark_ttft(slo_block: dict, spec: SLOSpec, *, reasoning: bool) -> None:
    """Say in `slo_block` (`slo.verdicts.evaluate`'s) which TTFT it and each objective that
    reads TTFT judged, in a run with reasoning or under a spec not on the default."""
    if not reasoning and spec.ttft == FIRST_TOKEN:
        return
    slo_block["ttft"] = spec.ttft
    for objective in slo_block.get("objectives") or []:
        if _reads_ttft(objective, spec):
            objective["ttft"] = spec.ttft
