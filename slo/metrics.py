"""Metric definitions: pure functions over numpy arrays and pyarrow tables.

Every time input is nanoseconds relative to the run's `t0_ns` (float64 with NaN where the
event never happened, as `slo.runrecord.float_column` returns them); every latency output
is milliseconds. "Undefined" is NaN in arrays and None in summaries, never 0.

Percentiles use linear interpolation between order statistics (numpy's default
`method="linear"`, which vLLM's `benchmarks/serve` uses too): for sorted values x[0..n-1],
the q-th percentile is x[h] interpolated at h = (n - 1) * q / 100.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from slo.runrecord import ChunkColumn, RequestStatus

NS_PER_MS = 1e6
NS_PER_S = 1e9
PERCENTILES = (50, 90, 95, 99)
STATUSES = tuple(s.value for s in RequestStatus if s.attempted)  # of requests that were sent


def ttft_ms(t_sent_ns: np.ndarray, t_first_token_ns: np.ndarray) -> np.ndarray:
    """Time to first token: send to the first token-bearing chunk, per request, in ms.

    NaN where either time is missing (the request never sent, or never got a token).
    """
    return (np.asarray(t_first_token_ns, float) - np.asarray(t_sent_ns, float)) / NS_PER_MS


def tpot_ms(
    t_first_token_ns: np.ndarray, t_last_token_ns: np.ndarray, output_tokens: np.ndarray
) -> np.ndarray:
    """Time per output token after the first, per request, in ms.

    (t_last_token - t_first_token) / (output_tokens - 1). Undefined (NaN, never 0) when the
    request produced fewer than two output tokens, or when a time or the count is missing.
    """
    first = np.asarray(t_first_token_ns, float)
    last = np.asarray(t_last_token_ns, float)
    tokens = np.asarray(output_tokens, float)
    decode_tokens = np.where(tokens >= 2, tokens - 1, np.nan)
    return (last - first) / NS_PER_MS / decode_tokens


def e2e_ms(t_sent_ns: np.ndarray, t_done_ns: np.ndarray) -> np.ndarray:
    """End-to-end latency: send to done (response fully received or failed), per request, in ms.

    NaN where either time is missing.
    """
    return (np.asarray(t_done_ns, float) - np.asarray(t_sent_ns, float)) / NS_PER_MS


def dispatch_lag_ms(
    t_scheduled_ns: np.ndarray, t_sent_ns: np.ndarray, t_slot_freed_ns: np.ndarray | None = None
) -> np.ndarray:
    """How late the client sent each request, in ms (NaN where the send time is missing):
    t_sent - t_free, where t_free is the later of its scheduled time and `t_slot_freed_ns`
    (when the concurrency-cap slot it took was freed; NaN or None: no cap, or a slot free
    from the start). A cap holding requests back is the load the run asked for; a large lag
    means the load generator, not the target, limited the offered load.
    """
    t_free_ns = np.asarray(t_scheduled_ns, float)
    if t_slot_freed_ns is not None:
        t_free_ns = np.fmax(t_free_ns, np.asarray(t_slot_freed_ns, float))  # NaN: the other
    return (np.asarray(t_sent_ns, float) - t_free_ns) / NS_PER_MS


@dataclass(frozen=True, eq=False)
class ChunkOrder:
    """A chunks table as numpy columns grouped by request and in time order within each
    request: `names[codes[i]]` is row i's request id. Built without sorting strings (the
    ids are dictionary-encoded) and without a permutation when the table is already so
    ordered, as the production writer leaves it (each request's chunks are written together,
    in arrival order); so a run of millions of chunks costs about 20 bytes per chunk here."""

    names: list[str]
    codes: np.ndarray  # int32 index into `names`, one per row
    t_ns: np.ndarray  # int64
    n_tokens: np.ndarray  # int32, null as 0
    n_chars: np.ndarray  # int32, null as 0

    @classmethod
    def of(cls, chunks: pa.Table | ChunkOrder) -> ChunkOrder:
        if isinstance(chunks, ChunkOrder):
            return chunks
        ids = chunks[ChunkColumn.REQUEST_ID]
        if ids.null_count:
            ids = pc.fill_null(ids, "")
        encoded = ids.dictionary_encode()
        names = encoded.chunks[0].dictionary.to_pylist() if encoded.num_chunks else []
        codes = _concat(
            [c.indices.to_numpy(zero_copy_only=False) for c in encoded.chunks], np.int32
        )
        del encoded, ids
        return cls._ordered(names, codes, *_count_columns(chunks))

    @classmethod
    def read(cls, run_dir) -> ChunkOrder:
        """The order of a run directory's chunks, read one row group at a time with the ids
        dictionary-encoded, so no column of id strings is ever built: the same order as
        `ChunkOrder.of(open_run(run_dir).chunks)`, without holding the table (about 60 bytes
        a chunk) beside it."""
        import pyarrow.parquet as pq

        from slo.runrecord import RunRecordError
        from slo.runrecord.reader import CHUNKS_FILE, table_files

        names: list[str] = []
        code_of: dict[str, int] = {}
        columns: list[list[np.ndarray]] = [[], [], [], []]
        for path in table_files(run_dir, CHUNKS_FILE):
            try:
                file = pq.ParquetFile(path, read_dictionary=[ChunkColumn.REQUEST_ID.value])
                for group in range(file.num_row_groups):
                    table = file.read_row_group(group)
                    columns[0].append(_codes(table[ChunkColumn.REQUEST_ID], names, code_of))
                    for parts, column in zip(columns[1:], _count_columns(table), strict=True):
                        parts.append(column)
                    del table
            except (OSError, pa.ArrowException) as exc:
                raise RunRecordError(f"{path} is not a readable parquet file ({exc}).") from exc
        codes, t_ns, n_tokens, n_chars = (
            _concat(parts, dtype)
            for parts, dtype in zip(columns, (np.int32, np.int64, np.int32, np.int32), strict=True)
        )
        del columns
        return cls._ordered(names, codes, t_ns, n_tokens, n_chars)

    @classmethod
    def _ordered(cls, names, codes, t_ns, n_tokens, n_chars) -> ChunkOrder:
        if not _grouped_in_time_order(codes, t_ns, len(names)):
            order = np.lexsort((t_ns, codes))
            codes, t_ns, n_tokens, n_chars = (a[order] for a in (codes, t_ns, n_tokens, n_chars))
        return cls(names, codes, t_ns, n_tokens, n_chars)

    def __len__(self) -> int:
        return int(self.codes.size)

    def gaps_by_request(self, keep: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Gaps (ms) between consecutive kept rows of each request, as `itl_ms_by_request`;
        requests with no kept row are absent, those with one map to an empty array."""
        codes, t_ns = (
            (self.codes, self.t_ns) if keep is None else (self.codes[keep], self.t_ns[keep])
        )
        n = codes.size
        if n == 0:
            return {}
        starts, ends = request_runs(codes)
        # gaps_ms[i] = t[i + 1] - t[i], in one float array (times below 2**53 ns are exact)
        gaps_ms = np.subtract(t_ns[1:], t_ns[:-1], dtype=np.float64)
        gaps_ms /= NS_PER_MS
        names = self.names
        return {
            names[code]: gaps_ms[s : e - 1]
            for code, s, e in zip(codes[starts].tolist(), starts, ends, strict=True)
        }


def _count_columns(table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A chunks table's `t_ns` (int64), `n_tokens` and `n_chars` (int32, null as 0)."""
    return (
        _int_column(table, ChunkColumn.T_NS, np.int64),
        _int_column(table, ChunkColumn.N_TOKENS, np.int32),
        _int_column(table, ChunkColumn.N_CHARS, np.int32),
    )


def _codes(ids: pa.ChunkedArray, names: list[str], code_of: dict[str, int]) -> np.ndarray:
    """Global codes of one row group's dictionary-encoded ids, new ids taking the next codes
    in order of first appearance (as `dictionary_encode` numbers them); a null id is ""."""
    parts = []
    for chunk in ids.chunks:
        indices = pc.fill_null(chunk.indices, 0) if chunk.null_count else chunk.indices
        local = indices.to_numpy(zero_copy_only=False)
        if chunk.null_count:
            # a null id reads as "": give it its own local index past the dictionary's
            missing = len(chunk.dictionary)
            local = np.where(chunk.is_null().to_numpy(zero_copy_only=False), missing, local)
        dictionary = chunk.dictionary.to_pylist() + [""]
        seen, first = np.unique(local, return_index=True)
        mapping = np.empty(len(dictionary), np.int32)
        for index in seen[np.argsort(first)].tolist():
            name = dictionary[index]
            code = code_of.get(name)
            if code is None:
                code = code_of[name] = len(names)
                names.append(name)
            mapping[index] = code
        parts.append(mapping[local] if local.size else np.empty(0, np.int32))
    return _concat(parts, np.int32)


def request_runs(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive) of each run of equal codes in grouped rows."""
    starts = np.concatenate(([0], np.flatnonzero(codes[1:] != codes[:-1]) + 1))
    return starts, np.concatenate((starts[1:], [codes.size]))


def _concat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype)


def _int_column(table: pa.Table, name: str, dtype) -> np.ndarray:
    column = table[name]
    if column.null_count:
        column = pc.fill_null(column, 0)
    parts = [c.to_numpy(zero_copy_only=False) for c in column.chunks]
    return _concat(parts, dtype)


def _grouped_in_time_order(codes: np.ndarray, t_ns: np.ndarray, n_names: int) -> bool:
    """True when each request's rows are contiguous and their times never go back."""
    if codes.size < 2:
        return True
    changes = codes[1:] != codes[:-1]
    if int(changes.sum()) + 1 != n_names:  # a request's rows come in more than one run
        return False
    return bool(np.all((np.diff(t_ns) >= 0) | changes))


def itl_ms_by_request(chunks: pa.Table | ChunkOrder) -> dict[str, np.ndarray]:
    """Inter-token latencies per request, in ms: gaps between consecutive token-bearing chunks.

    Only chunks with `n_tokens > 0` count (role-only and usage-only chunks are skipped). A
    chunk carrying k tokens is one gap, not k: this measures what a user sees stream in. A
    request with fewer than two token-bearing chunks maps to an empty array; requests with no
    token-bearing chunk at all are absent from the result.
    """
    order = ChunkOrder.of(chunks)
    return order.gaps_by_request(order.n_tokens > 0)


def pooled_itl_ms(itl_by_request: dict[str, np.ndarray], request_ids: Iterable[str]) -> np.ndarray:
    """All gaps of the given requests in one array (ms); the pooled ITL distribution."""
    arrays = [itl_by_request[r] for r in request_ids if r in itl_by_request]
    return np.concatenate(arrays) if arrays else np.empty(0)


def per_request_itl_ms(
    itl_by_request: dict[str, np.ndarray], request_ids: Sequence[str], reduce: str
) -> np.ndarray:
    """One ITL figure per request in `request_ids` order: `reduce` is "mean" or "max" (ms).

    "max" is the longest stall a user saw. NaN for a request with no gap (fewer than two
    token-bearing chunks).
    """
    if reduce not in ("mean", "max"):
        raise ValueError(f"reduce must be 'mean' or 'max', not {reduce!r}")
    out = np.full(len(request_ids), np.nan)
    for i, request_id in enumerate(request_ids):
        gaps = itl_by_request.get(request_id)
        if gaps is not None and gaps.size:
            out[i] = gaps.mean() if reduce == "mean" else gaps.max()
    return out


def percentile(values: np.ndarray, q: float) -> float | None:
    """The q-th percentile (0..100) of the defined (non-NaN) values, linear interpolation.

    None when no value is defined.
    """
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return None
    return float(np.percentile(values, q, method="linear"))


def distribution(values: np.ndarray) -> dict:
    """`{mean, p50, p90, p95, p99, max, n}` over the defined (non-NaN) values.

    `n` counts the defined values; with n == 0 every statistic is None.
    """
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    out: dict = {"mean": None}
    out.update({f"p{q}": None for q in PERCENTILES})
    out.update({"max": None, "n": int(values.size)})
    if values.size:
        out["mean"] = float(values.mean())
        for q, v in zip(
            PERCENTILES, np.percentile(values, PERCENTILES, method="linear"), strict=True
        ):
            out[f"p{q}"] = float(v)
        out["max"] = float(values.max())
    return out


def pooled_distribution(pooled) -> dict:
    """`distribution` of a pool of gaps (`slo.sketch.Pooled`), with `quantiles`: `exact`, or
    `sketch` when the percentiles come from a sketch, and `relative_error`: the bound on
    their relative error (0 exact). The mean, max and n are exact either way."""
    mean, values, largest = pooled.summary(PERCENTILES)
    out: dict = {"mean": mean}
    out.update({f"p{q}": v for q, v in zip(PERCENTILES, values, strict=True)})
    out.update({"max": largest, "n": pooled.n})
    out["quantiles"] = pooled.method
    out["relative_error"] = pooled.relative_error
    return out


def counts_distribution(counts: np.ndarray) -> dict:
    """`distribution` of the integers k = 0, 1, ... each seen `counts[k]` times, exactly (the
    order statistics are read from the cumulative counts, as `distribution` of the values)."""
    counts = np.asarray(counts, np.int64)
    n = int(counts.sum())
    out: dict = {"mean": None}
    out.update({f"p{q}": None for q in PERCENTILES})
    out.update({"max": None, "n": n})
    if n:
        ends = np.cumsum(counts)
        h = (n - 1) * np.asarray(PERCENTILES, float) / 100
        j = np.floor(h).astype(np.int64)
        low = np.searchsorted(ends, j, side="right").astype(float)
        high = np.searchsorted(ends, np.minimum(j + 1, n - 1), side="right").astype(float)
        keys = np.arange(counts.size, dtype=float)
        out["mean"] = float((keys * counts).sum() / n)
        out.update(
            {
                f"p{q}": float(v)
                for q, v in zip(PERCENTILES, low + (h - j) * (high - low), strict=True)
            }
        )
        out["max"] = float(np.flatnonzero(counts)[-1])
    return out


def measured_window_s(t_sent_ns: np.ndarray, t_done_ns: np.ndarray) -> float | None:
    """The measured window in seconds: first send to last done, over all requests.

    None when no request was sent or none finished, or when the window is not positive.
    """
    sent = np.asarray(t_sent_ns, float)
    done = np.asarray(t_done_ns, float)
    if np.all(np.isnan(sent)) or np.all(np.isnan(done)):
        return None
    window_s = (np.nanmax(done) - np.nanmin(sent)) / NS_PER_S
    return float(window_s) if window_s > 0 else None


def throughput(
    *,
    window_s: float | None,
    num_ok: int,
    num_requests: int,
    ok_input_tokens: float,
    ok_output_tokens: float,
) -> dict:
    """Request and token rates over the measured window, per second.

    `request_per_s`: requests that finished ok; `attempted_request_per_s`: all requests;
    token rates count the input and output tokens of ok requests only. All None when the
    window is undefined.
    """
    keys = (
        "request_per_s",
        "attempted_request_per_s",
        "input_tokens_per_s",
        "output_tokens_per_s",
        "total_tokens_per_s",
    )
    if not window_s:
        return dict.fromkeys(keys)
    values = (
        num_ok,
        num_requests,
        ok_input_tokens,
        ok_output_tokens,
        ok_input_tokens + ok_output_tokens,
    )
    return {k: float(v) / window_s for k, v in zip(keys, values, strict=True)}


def outcome_counts(status: np.ndarray, error_class: np.ndarray) -> dict:
    """`{total, by_status, by_error_class}`; every contract status appears (0 when absent).

    A null status counts as "unknown"; requests without an error class are not in
    `by_error_class`.
    """
    by_status = dict.fromkeys(STATUSES, 0)
    for s in status:
        key = s if s is not None else RequestStatus.UNKNOWN.value
        by_status[key] = by_status.get(key, 0) + 1
    by_error_class: dict[str, int] = {}
    for e in error_class:
        if e is not None:
            by_error_class[e] = by_error_class.get(e, 0) + 1
    return {
        "total": int(len(status)),
        "by_status": by_status,
        "by_error_class": dict(sorted(by_error_class.items())),
    }
