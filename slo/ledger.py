"""The ledger: proof that every scheduled request ended exactly once, none was invented, and the
target let go of everything afterwards (in the spirit of Jepsen's set checker).

Inputs are the run's own records: `schedule.parquet` (what the run meant to send),
`requests.parquet` and `warmup.parquet` (one row per outcome), and the manifest's
`server_state` (the target's `/metrics` gauges read before the run and after it drained).
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from slo.runrecord import RequestColumn, RequestStatus, RunTables, ScheduleColumn

# Gauges that must be back at their idle level after the run: name -> how it may compare.
IDLE_GAUGES = ("running", "waiting")
KV_GAUGES = ("kv_blocks_used", "kv_usage_perc")  # live blocks, not blocks only the cache holds


def _ids(table: pa.Table, column: str) -> list[str]:
    return table[column].to_pylist() if column in table.column_names else []


def leak_check(server_state: dict | None) -> dict:
    """`{checked, leaked, reasons, before, after}` from the manifest's `server_state`.

    A leak is a running or waiting request left after the drain, or live KV blocks above the
    level read before the run (a warm prefix cache is not live). Unchecked (`checked` false)
    when the target has no such gauges.
    """
    state = server_state or {}
    before, after = state.get("before") or {}, state.get("after") or {}
    if not after:
        return {"checked": False, "leaked": False, "reasons": [], "before": before, "after": after}
    reasons = []
    for name in IDLE_GAUGES:
        value = after.get(name)
        if value is not None and value > 0:
            reasons.append(f"{value:g} {name} request(s) left after the run drained")
    for name in KV_GAUGES:
        if after.get(name) is not None and before.get(name) is not None:
            if after[name] > before[name]:
                reasons.append(f"{name} {after[name]:g} after the run, {before[name]:g} before it")
            break  # the first gauge the target has is the one that counts
    return {
        "checked": True,
        "leaked": bool(reasons),
        "reasons": reasons,
        "before": before,
        "after": after,
    }


def ledger_summary(tables: RunTables) -> dict:
    """`{scheduled, recorded, lost, unexpected, outcomes, leak, verdict}`.

    `lost`: scheduled requests with no row; `unexpected`: rows for requests that were not
    scheduled, plus every row beyond the first for a request; `outcomes`: rows by status.
    `verdict` is `ok` when lost, unexpected and leaked are all zero, `unchecked` for a run
    without a schedule (written before the ledger existed: lost and unexpected are None), else
    `failed`.
    """
    scheduled = _ids(tables.schedule, ScheduleColumn.REQUEST_ID)
    rows = _ids(tables.requests, RequestColumn.REQUEST_ID) + _ids(
        tables.warmup, RequestColumn.REQUEST_ID
    )
    statuses = _ids(tables.requests, RequestColumn.STATUS) + _ids(
        tables.warmup, RequestColumn.STATUS
    )
    seen = Counter(rows)
    expected = set(scheduled)
    lost = sorted(expected - set(seen))
    unexpected = sum(n for rid, n in seen.items() if rid not in expected) + sum(
        n - 1 for rid, n in seen.items() if rid in expected and n > 1
    )
    leak = leak_check(tables.manifest.server_state if tables.manifest else None)
    if not scheduled:  # written before runs kept their schedule: nothing to check against
        return {
            "scheduled": None,
            "recorded": len(rows),
            "lost": None,
            "lost_ids": [],
            "unexpected": None,
            "leaked": int(leak["leaked"]),
            "outcomes": _outcomes(statuses),
            "leak": leak,
            "verdict": "failed" if leak["leaked"] else "unchecked",
        }
    verdict = "failed" if (lost or unexpected or leak["leaked"]) else "ok"
    return {
        "scheduled": len(scheduled),
        "recorded": len(rows),
        "lost": len(lost),
        "lost_ids": lost[:20],
        "unexpected": unexpected,
        "leaked": int(leak["leaked"]),
        "outcomes": _outcomes(statuses),
        "leak": leak,
        "verdict": verdict,
    }


def _outcomes(statuses: list[str]) -> dict[str, int]:
    outcomes = dict.fromkeys((s.value for s in RequestStatus), 0)
    for status in statuses:
        outcomes[status] = outcomes.get(status, 0) + 1
    return outcomes
