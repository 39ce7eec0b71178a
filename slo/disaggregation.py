"""A prefill/decode cluster's KV handoffs: the `disaggregation` block of the summary.

In a P/D cluster each request's prompt runs on a prefill worker, its KV blocks travel to a
decode worker over a link, and the decode worker produces the rest. What that costs per
request is in requests.parquet (`harness.load.kv_records`, from the router's
`usage.kv_transfer`): the prefill time, the bytes and time of the handoff, the install time,
whether it succeeded and how it was retried, and the worker that served the request.

The block (None when no request carries any of those columns, so a single server's run has
none), over the sent requests that carry each figure, whatever their outcome (a handoff cost
what it cost even if the request later failed):
- `requests_with_transfer`: requests whose answer reported a handoff (its bytes, time or
  outcome); `transfers_ok`, `transfers_failed` (`ok` true, false) and `transfers_retried`;
- `prefill_time_ms`, `transfer_time_ms`, `install_time_ms`, `transfer_bytes_per_request`:
  distributions (p50, p90, p99, ...) over the requests reporting each;
- the effective link bandwidth, `B_effective = sum(bytes) / sum(transfer_ms)` over the
  handoffs not reported failed that reported both (`bandwidth_transfers` of them), in MB/s
  (10^6 bytes a second): the rate the link delivered KV at, set-up, framing, checksums and
  whatever else the target counts in `transfer_ms` (the reference router: the install too)
  included. None when those handoffs took no measurable time in all (0 ms has no rate) or
  there are none;
- `requests_by_worker`: requests per serving worker (`served_by`), by name.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa

from slo import metrics
from slo.runrecord import RequestColumn, float_column, string_column

BANDWIDTH_FORMULA = "B_effective = sum(bytes) / sum(transfer_ms), handoffs not failed (MB/s)"
BYTES_PER_MB = 1e6
MS_PER_S = 1e3
COLUMNS = (
    RequestColumn.KV_PREFILL_MS,
    RequestColumn.KV_TRANSFER_BYTES,
    RequestColumn.KV_TRANSFER_MS,
    RequestColumn.KV_INSTALL_MS,
)


def _ok_column(requests: pa.Table) -> np.ndarray:
    """`kv_transfer_ok` as 1.0 (true), 0.0 (false) or NaN (unsaid)."""
    values = string_column(requests, RequestColumn.KV_TRANSFER_OK)
    return np.array([np.nan if v is None else float(v) for v in values], float)


def effective_bandwidth_mb_per_s(total_bytes: float, total_ms: float) -> float | None:
    """`total_bytes` / `total_ms` in MB/s; None when no time passed (0 ms has no rate)."""
    if not total_ms > 0:
        return None
    return total_bytes / BYTES_PER_MB / (total_ms / MS_PER_S)


def disaggregation_summary(requests: pa.Table) -> dict | None:
    """The `disaggregation` block (module doc); None when no request carries a KV-handoff
    figure or a serving worker."""
    figures = {column: float_column(requests, column) for column in COLUMNS}
    ok = _ok_column(requests)
    retried = string_column(requests, RequestColumn.KV_TRANSFER_RETRIED)
    workers = string_column(requests, RequestColumn.SERVED_BY)
    said = ~np.isnan(ok) | (retried != None) | (workers != None)  # noqa: E711 (elementwise)
    for values in figures.values():
        said |= ~np.isnan(values)
    if not said.any():
        return None
    size = figures[RequestColumn.KV_TRANSFER_BYTES]
    took = figures[RequestColumn.KV_TRANSFER_MS]
    with_transfer = ~np.isnan(ok) | ~np.isnan(size) | ~np.isnan(took)
    counted = (ok != 0.0) & ~np.isnan(size) & ~np.isnan(took)  # NaN != 0: unsaid counts
    total_bytes, total_ms = float(size[counted].sum()), float(took[counted].sum())
    return dict(
        requests_with_transfer=int(with_transfer.sum()),
        transfers_ok=int((ok == 1.0).sum()),
        transfers_failed=int((ok == 0.0).sum()),
        transfers_retried=int((retried != None).sum()),  # noqa: E711 (elementwise)
        prefill_time_ms=metrics.distribution(figures[RequestColumn.KV_PREFILL_MS]),
        transfer_time_ms=metrics.distribution(took),
        install_time_ms=metrics.distribution(figures[RequestColumn.KV_INSTALL_MS]),
        transfer_bytes_per_request=metrics.distribution(size),
        bandwidth_transfers=int(counted.sum()),
        total_transfer_bytes=int(total_bytes),
        total_transfer_ms=total_ms,
        effective_bandwidth_mb_per_s=effective_bandwidth_mb_per_s(total_bytes, total_ms),
        bandwidth_formula=BANDWIDTH_FORMULA,
        requests_by_worker=dict(sorted(Counter(w for w in workers if w is not None).items())),
        definitions=dict(
            prefill_time_ms="the prefill worker's time from arrival to the first token",
            transfer_time_ms="export, send and install of the KV handoff, as the target reports it",
            install_time_ms="the decode worker's install of the handed-off blocks",
            transfer_bytes_per_request="bytes sent on the KV link, framing included",
            effective_bandwidth_mb_per_s=BANDWIDTH_FORMULA,
        ),
    )
