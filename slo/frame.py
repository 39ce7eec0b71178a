"""Per-request metric arrays derived once from a run's tables, sliceable by a boolean mask."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from slo import metrics
from slo.chunk_digest import TOKEN, ChunkDigest
from slo.errors import SLOError
from slo.runrecord import RequestColumn, RequestStatus, float_column, string_column
from slo.sketch import Pooled


def attempted_requests(requests: pa.Table) -> pa.Table:
    """`requests` without its `not_sent` rows (the table itself when it has none: a filter
    copies every column, 12 MB for 30,000 requests, and the summary asks many times)."""
    if RequestColumn.STATUS not in requests.column_names or requests.num_rows == 0:
        return requests
    sent = pc.fill_null(
        pc.not_equal(requests[RequestColumn.STATUS], RequestStatus.NOT_SENT.value), True
    )
    return requests if pc.all(sent).as_py() else requests.filter(sent)


def not_sent_count(requests: pa.Table) -> int:
    """Rows of requests the run scheduled but never sent."""
    return requests.num_rows - attempted_requests(requests).num_rows


@dataclass(frozen=True, eq=False)
class RequestMetrics:
    """Raw facts and derived latencies for each request, aligned by index.

    Times are ns relative to t0 (float64, NaN = never happened); latencies are ms (NaN =
    undefined). `itl_by_request` maps request_id to its chunk gaps in ms and is shared, not
    sliced, by `subset`. Built from a `ChunkDigest`, `itl_pool` holds the gaps (exact or a
    sketch, `slo.sketch`) and `itl_codes` each request's code in it (-1: no chunk); with a
    sketch `itl_by_request` is empty and the pooled figures come from `pooled_itl`.
    """

    request_id: np.ndarray
    status: np.ndarray
    error_class: np.ndarray
    error_message: np.ndarray
    output_tokens_source: np.ndarray
    t_scheduled_ns: np.ndarray
    t_sent_ns: np.ndarray
    t_first_token_ns: np.ndarray
    t_last_token_ns: np.ndarray
    t_done_ns: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    ttft_ms: np.ndarray
    tpot_ms: np.ndarray
    e2e_ms: np.ndarray
    itl_mean_ms: np.ndarray
    itl_max_ms: np.ndarray
    itl_by_request: dict
    itl_pool: object = None  # slo.sketch.GapPool, shared by `subset`
    itl_codes: np.ndarray | None = None

    @classmethod
    def from_tables(
        cls, requests: pa.Table, chunks: pa.Table | metrics.ChunkOrder | ChunkDigest
    ) -> RequestMetrics:
        """Build from a contract `requests` table and `chunks` table (may be empty).

        Rows of requests that were never sent (`not_sent`: the run stopped first) are left out:
        every metric is over the requests the target saw. `not_sent_count` counts them.
        """
        requests = attempted_requests(requests)
        request_id = string_column(requests, RequestColumn.REQUEST_ID)
        t = {str(name): float_column(requests, name) for name in (
            RequestColumn.T_SCHEDULED_NS, RequestColumn.T_SENT_NS, RequestColumn.T_FIRST_TOKEN_NS,
            RequestColumn.T_LAST_TOKEN_NS, RequestColumn.T_DONE_NS,
        )}  # fmt: skip
        output_tokens = float_column(requests, RequestColumn.OUTPUT_TOKENS)
        ids = list(request_id)
        pool = codes = None
        if isinstance(chunks, ChunkDigest):
            pool, codes = chunks.pools[TOKEN], chunks.codes(ids)
            itl = chunks.by_request(TOKEN) if pool.method == "exact" else {}
        else:
            itl = metrics.itl_ms_by_request(chunks)
        if pool is not None and pool.method != "exact":  # per request, exact all the same
            has = codes >= 0
            count = np.where(has, pool.count[codes], 0)
            itl_mean = np.full(len(ids), np.nan)
            itl_max = np.full(len(ids), np.nan)
            gaps = count > 0
            itl_mean[gaps] = pool.total[codes[gaps]] / count[gaps]
            itl_max[gaps] = pool.high[codes[gaps]]
        else:
            itl_mean = metrics.per_request_itl_ms(itl, ids, "mean")
            itl_max = metrics.per_request_itl_ms(itl, ids, "max")
        return cls(
            request_id=request_id,
            status=string_column(requests, RequestColumn.STATUS),
            error_class=string_column(requests, RequestColumn.ERROR_CLASS),
            error_message=string_column(requests, RequestColumn.ERROR_MESSAGE),
            output_tokens_source=string_column(requests, RequestColumn.OUTPUT_TOKENS_SOURCE),
            input_tokens=float_column(requests, RequestColumn.INPUT_TOKENS),
            output_tokens=output_tokens,
            ttft_ms=metrics.ttft_ms(t[RequestColumn.T_SENT_NS], t[RequestColumn.T_FIRST_TOKEN_NS]),
            tpot_ms=metrics.tpot_ms(
                t[RequestColumn.T_FIRST_TOKEN_NS], t[RequestColumn.T_LAST_TOKEN_NS], output_tokens
            ),
            e2e_ms=metrics.e2e_ms(t[RequestColumn.T_SENT_NS], t[RequestColumn.T_DONE_NS]),
            itl_mean_ms=itl_mean,
            itl_max_ms=itl_max,
            itl_by_request=itl,
            itl_pool=pool,
            itl_codes=codes,
            **t,
        )

    def __len__(self) -> int:
        return int(self.request_id.size)

    @property
    def is_ok(self) -> np.ndarray:
        """True where the request finished with status `ok`."""
        return self.status == RequestStatus.OK.value

    def subset(self, mask: np.ndarray) -> RequestMetrics:
        """The requests where `mask` is true (a new object; arrays are copies)."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            shared = value is None or f.name in ("itl_by_request", "itl_pool")
            values[f.name] = value if shared else value[mask]
        return RequestMetrics(**values)

    def pooled_itl_ms(self, mask: np.ndarray | None = None) -> np.ndarray:
        """All chunk gaps (ms) of the requests selected by `mask` (default: all); an exact
        pool only (`pooled_itl` reads a sketch too)."""
        if self.itl_pool is not None and self.itl_pool.method != "exact":
            raise SLOError(
                "the run's chunk gaps are held as a sketch (over the memory budget), not one by "
                "one; read them through pooled_itl."
            )
        ids = self.request_id if mask is None else self.request_id[mask]
        return metrics.pooled_itl_ms(self.itl_by_request, ids)

    def pooled_itl(self, mask: np.ndarray | None = None) -> Pooled:
        """The chunk gaps of the requests selected by `mask` (default: all): exact, or the
        merged sketch of theirs."""
        if self.itl_pool is None:
            return Pooled.exact(self.pooled_itl_ms(mask))
        codes = self.itl_codes if mask is None else self.itl_codes[mask]
        return self.itl_pool.select(codes[codes >= 0])

    def window_s(self) -> float | None:
        """The measured window: first send to last done over these requests, in s."""
        return metrics.measured_window_s(self.t_sent_ns, self.t_done_ns)
