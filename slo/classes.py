"""Request classes in the summary: slices by tenant and by priority, the fairness of the
service the tenants got, and how many deadlines were missed (`workloads.classes` gives each
request its tenant, priority and deadline; the run records keep them).

Fairness. Tenants rarely ask for the same amount, so raw goodput per tenant says little: a
tenant that sends one request a second cannot get ten. Each tenant's goodput is compared with
its max-min fair share of the goodput the run delivered (water-filling: the capacity, the sum
of every tenant's goodput, is split equally; a tenant that asked for less than its equal part
gets what it asked for, and the rest is split again among the others). A tenant's demand is
its rate of sent requests over the measured window. Jain's index over the normalised goodput
x_i = goodput_i / fair_share_i is (sum x)^2 / (n * sum x^2): 1 when every tenant got its fair
share, 1/n when one tenant got everything. Served first come first served under overload, the
light tenant gets the same fraction of its demand as the heavy one, less than its fair share,
and the index drops; a fair scheduler serves the light tenant's whole demand. Good means ok
within every per-request objective of the SLO spec, or ok when there is none.

Deadlines. A request with a deadline met it when it finished ok, was not cut short by the
server for lateness (finish reason `deadline`), and its end-to-end latency is within the
deadline. The misses are split: `late` (finished ok, after the deadline), `dropped` (the server
ended it with finish reason `deadline`), `rejected` (turned away, e.g. 429: not admitted
because it could not be met) and `failed` (any other outcome); in the summary's `deadlines`
block: finished_late, dropped_by_server, rejected_at_admission, failed_otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from slo.frame import RequestMetrics, attempted_requests
from slo.goodput import good_mask
from slo.runrecord import RequestColumn, RequestStatus, float_column, string_column
from slo.slices import slice_summary
from slo.spec import SLOSpec

NO_TENANT = "(none)"
DEADLINE_FINISH_REASON = "deadline"
FAIRNESS_DEFINITION = (
    "Jain's index over each tenant's goodput divided by its max-min fair share of the run's "
    "goodput, demands = sent requests per second"
)
DEADLINE_DEFINITION = (
    "met: ok, not ended by the server for its deadline, e2e within the deadline; missed: the rest"
)


def jain_index(values: np.ndarray) -> float | None:
    """(sum x)^2 / (n * sum x^2); None for no values or all zero."""
    x = np.asarray(values, float)
    square_sum = float(np.sum(x * x))
    if x.size == 0 or square_sum == 0:
        return None
    return float(np.sum(x)) ** 2 / (x.size * square_sum)


def max_min_shares(demands: np.ndarray, capacity: float) -> np.ndarray:
    """Max-min fair shares of `capacity` among `demands` (water-filling)."""
    demands = np.asarray(demands, float)
    shares = np.zeros(demands.shape)
    remaining = float(capacity)
    order = np.argsort(demands, kind="stable")
    for k, i in enumerate(order):
        shares[i] = min(demands[i], remaining / (len(order) - k))
        remaining -= shares[i]
    return shares


@dataclass(frozen=True)
class ClassColumns:
    """The class columns of the sent requests, aligned with `RequestMetrics.from_tables`, read
    once for the three blocks: `tenant` names ("(none)" for a request without one; None when
    no request has a tenant), `priority` and `deadline_ms` (NaN: none), `finish_reason`."""

    tenant: np.ndarray | None
    priority: np.ndarray
    deadline_ms: np.ndarray
    finish_reason: np.ndarray

    @classmethod
    def of(cls, requests: pa.Table) -> ClassColumns:
        sent = attempted_requests(requests)
        tenant = string_column(sent, RequestColumn.TENANT)
        has_tenant = any(t is not None for t in tenant)
        return cls(
            tenant=np.asarray([NO_TENANT if t is None else t for t in tenant], dtype=object)
            if has_tenant
            else None,
            priority=float_column(sent, RequestColumn.PRIORITY),
            deadline_ms=float_column(sent, RequestColumn.DEADLINE_MS),
            finish_reason=string_column(sent, RequestColumn.FINISH_REASON),
        )


def class_slices(columns: ClassColumns, rm: RequestMetrics, spec: SLOSpec | None) -> dict:
    """`{tenant: [...], priority: [...]}` slices (`slice_summary` entries), each dimension
    only when some request has it; requests without one are the slice "(none)"."""
    out: dict[str, list] = {}
    names = columns.tenant
    if names is not None:
        out["tenant"] = [
            {"label": name, "range": None, **slice_summary(rm, names == name, spec, None)}
            for name in sorted(set(names.tolist()))
        ]
    priority = columns.priority
    if not np.isnan(priority).all():
        out["priority"] = []
        for value in sorted(set(priority[~np.isnan(priority)].tolist())):
            mask = priority == value
            out["priority"].append(
                {
                    "label": f"{value:g}",
                    "range": [value, value + 1],
                    **slice_summary(rm, mask, spec, None),
                }
            )
        if np.isnan(priority).any():
            mask = np.isnan(priority)
            out["priority"].append(
                {"label": NO_TENANT, "range": None, **slice_summary(rm, mask, spec, None)}
            )
    return out


def fairness_summary(
    columns: ClassColumns, rm: RequestMetrics, spec: SLOSpec | None
) -> dict | None:
    """Per tenant: demand, goodput, max-min fair share and normalised goodput; Jain's index
    over the normalised goodput (module doc). None without tenants or a measured window."""
    names = columns.tenant
    window = rm.window_s()
    if names is None or not window:
        return None
    good = good_mask(rm, spec) if spec is not None else rm.is_ok
    labels = sorted(set(names.tolist()))
    demand = np.asarray([np.sum(names == name) / window for name in labels])
    goodput = np.asarray([np.sum(good & (names == name)) / window for name in labels])
    shares = max_min_shares(demand, float(goodput.sum()))
    normalised = np.divide(goodput, shares, out=np.zeros_like(goodput), where=shares > 0)
    return {
        "jain_index": jain_index(normalised) if shares.sum() > 0 else None,
        "raw_jain_index": jain_index(goodput),
        "definition": FAIRNESS_DEFINITION,
        "window_s": window,
        "tenants": [
            {
                "tenant": name,
                "sent_request_per_s": float(d),
                "goodput_request_per_s": float(g),
                "fair_share_request_per_s": float(s),
                "normalised_goodput": float(x) if s > 0 else None,
            }
            for name, d, g, s, x in zip(labels, demand, goodput, shares, normalised, strict=True)
        ],
    }


def deadlines_summary(columns: ClassColumns, rm: RequestMetrics) -> dict | None:
    """How many requests with a deadline met it, and how the others missed (module doc);
    None when no request had a deadline."""
    deadline = columns.deadline_ms
    has = ~np.isnan(deadline)
    if not has.any():
        return None
    ok = rm.is_ok
    dropped = has & (columns.finish_reason == DEADLINE_FINISH_REASON)
    in_time = np.nan_to_num(rm.e2e_ms, nan=np.inf) <= np.nan_to_num(deadline, nan=-np.inf)
    met = has & ok & ~dropped & in_time
    late = has & ok & ~dropped & ~in_time
    rejected = has & ~dropped & (rm.status == RequestStatus.REJECTED.value)
    failed = has & ~ok & ~dropped & ~rejected
    n = int(has.sum())
    missed = n - int(met.sum())
    return {
        "with_deadline": n,
        "met_deadline": int(met.sum()),
        "missed_deadline": missed,
        "miss_rate": missed / n,
        "finished_late": int(late.sum()),
        "dropped_by_server": int(dropped.sum()),
        "rejected_at_admission": int(rejected.sum()),
        "failed_otherwise": int(failed.sum()),
        "definition": DEADLINE_DEFINITION,
    }
