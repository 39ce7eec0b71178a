"""One CSV row per request: the raw columns of `requests.parquet` (times in ns from the run's
t0) followed by the derived per-request latencies in ms (`ttft_ms`, `tpot_ms`, `e2e_ms`,
`queue_ms`, `itl_mean_ms`, `itl_max_ms`) as `slo` defines them; an undefined value is empty."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from reports.exports import read_run
from slo import metrics
from slo.runrecord import RequestColumn

DERIVED_MS = ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "itl_mean_ms", "itl_max_ms")


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}" if not value.is_integer() else str(int(value))
    return str(value)


def requests_csv(run_dir: Path | str) -> str:
    """The per-request CSV text for `run_dir` (every scheduled request, `not_sent` ones
    included, in the table's order). Raises ReportError for an unreadable run directory."""
    tables, rm = read_run(run_dir)
    requests = tables.requests
    derived = {
        rid: (ttft, tpot, e2e, queue, itl_mean, itl_max)
        for rid, ttft, tpot, e2e, queue, itl_mean, itl_max in zip(
            rm.request_id, rm.ttft_ms, rm.tpot_ms, rm.e2e_ms,
            metrics.dispatch_lag_ms(rm.t_scheduled_ns, rm.t_sent_ns), rm.itl_mean_ms,
            rm.itl_max_ms, strict=True,
        )
    }  # fmt: skip
    columns = requests.column_names
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*columns, *DERIVED_MS])
    ids = requests[RequestColumn.REQUEST_ID.value].to_pylist()
    rows = requests.to_pylist()
    for rid, row in zip(ids, rows, strict=True):
        extra = derived.get(rid, (None,) * len(DERIVED_MS))
        writer.writerow([_cell(row[c]) for c in columns] + [_cell(v) for v in extra])
    return out.getvalue()
