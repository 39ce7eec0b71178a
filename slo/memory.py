"""Memory per request: what the target reported for each request, or, for targets that report
only their KV cache gauge, an estimate from it (the card says which).

Reported (`source: reported`): the reference engine's `usage.kv_memory`, kept per request in
requests.parquet (`kv_peak_bytes`, ...; `engine_ref.core.kv_accounting` defines each figure).
The distributions are over the ok requests that carry the field; requests whose context was
evicted lossily (`kv_evicted_tokens` > 0) are counted.

Estimated (`source: estimated`): vLLM and the like export `kv_cache_usage_perc` (used blocks /
all blocks) and `num_requests_running`. At each scrape with requests running, usage / running
is the pool share an average running request held then; over the run's scrapes that gives a
distribution of the share per request, in bytes when the target reports its pool's bytes
(the reference engine's `/info` `kv_geometry`, in the manifest). It is an estimate: it spreads
the pool evenly over the running requests (a long prompt holds more than a short one), counts
blocks cached for reuse but free as unused only where the target does, and sees only the
instants the scraper sampled.
"""

from __future__ import annotations

import numpy as np

from slo.metrics import distribution
from slo.runrecord import RequestColumn, RequestStatus, RunTables, float_column, string_column
from slo.server_metrics import GAUGES, series_by_time

REPORTED = (
    RequestColumn.KV_PEAK_BYTES,
    RequestColumn.KV_MEAN_BYTES,
    RequestColumn.KV_AMORTISED_BYTES,
    RequestColumn.KV_UNUSED_BYTES,
    RequestColumn.TEMP_PEAK_BYTES,
)
NO_MEMORY = (
    "the target reports no memory per request (no usage.kv_memory) and no KV cache gauge "
    "with a running count in /metrics"
)


def memory_summary(tables: RunTables) -> dict:
    """The `memory` block (module doc)."""
    requests = tables.requests
    ok = string_column(requests, RequestColumn.STATUS) == RequestStatus.OK.value
    peak = float_column(requests, RequestColumn.KV_PEAK_BYTES)
    if np.any(~np.isnan(peak[ok])):
        evicted = float_column(requests, RequestColumn.KV_EVICTED_TOKENS)
        evicted = np.nan_to_num(evicted, nan=0.0)
        block = {"source": "reported", "reason": None}
        for column in REPORTED:
            block[str(column)] = distribution(float_column(requests, column)[ok])
        block["requests_evicted"] = int(np.count_nonzero(evicted > 0))
        block["evicted_tokens"] = int(evicted.sum())
        block["estimate"] = _estimate(tables)
        return block
    estimate = _estimate(tables)
    if estimate is None:
        return {"source": None, "reason": NO_MEMORY}
    return {"source": "estimated", "reason": None, "estimate": estimate}


def _estimate(tables: RunTables) -> dict | None:
    """The share of the KV pool per running request at each scrape (module doc); None when
    the target has not both gauges or never had a request running when scraped."""
    names = dict(GAUGES)
    usage = series_by_time(tables.server_metrics, names["kv_cache_usage"])
    running = series_by_time(tables.server_metrics, names["running"])
    if usage is None or running is None:
        return None
    by_time = dict(zip(running[0].tolist(), running[1].tolist(), strict=True))
    shares = [u / by_time[t] for t, u in zip(*usage, strict=True) if by_time.get(t, 0) > 0]
    if not shares:
        return None
    share = np.asarray(shares, float)
    geometry = ((tables.manifest.target if tables.manifest else None) or {}).get("kv_geometry")
    pool = (geometry or {}).get("pool_bytes")
    pool = int(pool) if isinstance(pool, int | float) and pool > 0 else None
    return {
        "samples": int(share.size),
        "pool_share": distribution(share),
        "pool_bytes": pool,
        "bytes_per_request": distribution(share * pool) if pool else None,
    }
