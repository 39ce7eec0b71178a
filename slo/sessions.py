"""Per-session metrics of a multi-turn run: session duration, TTFT by turn index and the
prefix-cache hit rate the server reported (`usage.prompt_tokens_details.cached_tokens`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from slo.metrics import distribution, ttft_ms
from slo.runrecord import RequestColumn, RequestStatus, float_column, string_column


def cache_hit_rate(cached_tokens: np.ndarray, prompt_tokens: np.ndarray) -> float | None:
    """Prompt tokens served from the prefix cache / prompt tokens, over the requests that
    report both (NaN marks a missing figure); None when none does or no prompt token was
    counted."""
    cached, prompt = np.asarray(cached_tokens, float), np.asarray(prompt_tokens, float)
    both = ~np.isnan(cached) & ~np.isnan(prompt)
    total = prompt[both].sum()
    return float(cached[both].sum() / total) if both.any() and total > 0 else None


def sessions_summary(requests: pa.Table) -> dict | None:
    """None for a run without sessions, else:

    - `sessions`: number of sessions; `complete`: those whose every turn ended `ok`;
      `turns`: turns per session `{mean, p50, ..., max, n}`; `turns_not_sent`: turns left
      unsent (their session's earlier turn failed, or the run ended first).
    - `duration_s`: per complete session, its first turn's send to its last turn's done
      (think times included), as a distribution.
    - `by_turn`: one entry per turn index, `{turn, n, ok, ttft_ms: {...}, prompt_tokens_mean,
      cached_tokens_mean, cache_hit_rate}` (TTFT over the turn's ok requests).
    - `cache_hit_rate`: cached / prompt tokens over every turn that reports both; None when the
      server reports no cached tokens.
    """
    session = string_column(requests, RequestColumn.SESSION_ID)
    has = np.array([s is not None for s in session], dtype=bool)
    if not has.any():
        return None
    table = requests.filter(pa.array(has))
    session = session[has]
    turn = float_column(table, RequestColumn.TURN_INDEX)
    status = string_column(table, RequestColumn.STATUS)
    ok = status == RequestStatus.OK.value
    sent = float_column(table, RequestColumn.T_SENT_NS)
    done = float_column(table, RequestColumn.T_DONE_NS)
    ttft = ttft_ms(sent, float_column(table, RequestColumn.T_FIRST_TOKEN_NS))
    prompt = float_column(table, RequestColumn.USAGE_PROMPT_TOKENS)
    cached = float_column(table, RequestColumn.USAGE_CACHED_TOKENS)

    ids, inverse = np.unique(session.astype(str), return_inverse=True)
    n_turns = np.bincount(inverse, minlength=len(ids))
    n_ok = np.bincount(inverse, weights=ok, minlength=len(ids))
    complete = n_ok == n_turns
    durations = []
    for k in np.flatnonzero(complete):
        rows = inverse == k
        durations.append((np.nanmax(done[rows]) - np.nanmin(sent[rows])) / 1e9)
    by_turn = []
    for t in sorted({int(x) for x in turn[~np.isnan(turn)]}):
        rows = turn == t
        by_turn.append(
            {
                "turn": t,
                "n": int(rows.sum()),
                "ok": int((rows & ok).sum()),
                "ttft_ms": distribution(np.where(ok, ttft, np.nan)[rows]),
                "prompt_tokens_mean": _mean(prompt[rows]),
                "cached_tokens_mean": _mean(cached[rows]),
                "cache_hit_rate": cache_hit_rate(cached[rows], prompt[rows]),
            }
        )
    return {
        "sessions": int(len(ids)),
        "complete": int(complete.sum()),
        "turns": distribution(n_turns.astype(float)),
        "turns_not_sent": int((status == RequestStatus.NOT_SENT.value).sum()),
        "duration_s": distribution(np.asarray(durations, dtype=float)),
        "by_turn": by_turn,
        "cache_hit_rate": cache_hit_rate(cached, prompt),
    }


def _mean(values: np.ndarray) -> float | None:
    values = values[~np.isnan(values)]
    return float(values.mean()) if values.size else None
