"""The `disaggregation` block of `summary.json`: a cluster's KV handoffs and serving workers.

Written by `slo.disaggregation.disaggregation_summary` (the definitions are in that module's
docstring) from requests.parquet's `kv_*` and `served_by` columns; absent (None) for a run in
which no request carried any of them (every single server, every other engine). Times in ms,
sizes in bytes, the bandwidth in MB/s (10^6 bytes a second).
"""

from __future__ import annotations

from dataclasses import dataclass

from slo.runrecord.section import Section, nested
from slo.runrecord.sections import Distribution


@dataclass(frozen=True)
class Disaggregation(Section):
    """`disaggregation` (`slo.disaggregation`): `requests_with_transfer` requests carried a
    KV handoff, `transfers_ok` of them succeeded, `transfers_failed` failed and
    `transfers_retried` were retried (by recompute); distributions of the prefill, transfer and
    install times and of the bytes per handoff; the effective link bandwidth
    `total_transfer_bytes` / `total_transfer_ms` over the `bandwidth_transfers` handoffs not
    reported failed (None without time to divide by), its formula in `bandwidth_formula`;
    `requests_by_worker` counts the requests each worker served; `definitions` in words."""

    requests_with_transfer: int | None = None
    transfers_ok: int | None = None
    transfers_failed: int | None = None
    transfers_retried: int | None = None
    prefill_time_ms: Distribution | None = nested(Distribution)
    transfer_time_ms: Distribution | None = nested(Distribution)
    install_time_ms: Distribution | None = nested(Distribution)
    transfer_bytes_per_request: Distribution | None = nested(Distribution)
    bandwidth_transfers: int | None = None
    total_transfer_bytes: int | None = None
    total_transfer_ms: float | None = None
    effective_bandwidth_mb_per_s: float | None = None
    bandwidth_formula: str | None = None
    requests_by_worker: dict | None = None
    definitions: dict | None = None
