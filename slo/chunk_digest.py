"""One pass over a run's chunks, a row batch at a time: what the summary needs of them.

`ChunkOrder` holds every chunk (20 bytes each) and the gaps derived from it another 8 bytes
a chunk per kind, so a summary's memory grew with the run: 1,369 MB for 15,000 streams of
1,024 tokens, twice that for twice the run. The digest reads `chunks.parquet` in row batches
(`iter_batches`, ids dictionary-encoded), carries the last request of a batch into the next
(so gaps are taken within a request across batch boundaries), and keeps per request only
what the figures need: the first and last time of each kind of chunk, and its gaps in a
`slo.sketch.GapPool` (exact while they fit the memory budget, a sketch beyond). The tokens
per chunk of ok requests are an exact histogram of small integers.

The production writer puts each request's chunks together in arrival order; a table that is
not so grouped (hand-made, or concatenated from elsewhere) cannot be digested a batch at a
time and is ordered in memory instead (`ChunkOrder.read`, unbounded), with the same result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from slo import metrics
from slo.runrecord import ChunkColumn
from slo.sketch import GapPool, Pooled, exact_gap_limit

TOKEN, CONTENT, ANY, THROUGH_LAST_TOKEN = "token", "content", "any", "through_last_token"
BATCH_ROWS = 1 << 16
COLUMNS = tuple(
    c.value
    for c in (ChunkColumn.REQUEST_ID, ChunkColumn.T_NS, ChunkColumn.N_TOKENS, ChunkColumn.N_CHARS)
)


class _NotGrouped(Exception):
    """A request's chunks come in more than one run: order them in memory instead."""


@dataclass
class ChunkDigest:
    """Per request code (`names[code]` its id): first and last chunk time (ns, NaN: none) of
    each kind in `first_ns` / `last_ns`, the gap pools of the kinds asked for, the histogram
    of tokens per token-bearing chunk of ok requests (`ok_tokens[k]` chunks carried k), and
    with `keep_token_rows` the token-bearing rows as a `ChunkOrder` (None beyond the budget)."""

    names: list[str]
    first_ns: dict[str, np.ndarray]
    last_ns: dict[str, np.ndarray]
    pools: dict[str, GapPool]
    ok_tokens: np.ndarray
    token_rows: metrics.ChunkOrder | None = None
    _code_of: dict = field(default_factory=dict, repr=False)

    def codes(self, request_ids) -> np.ndarray:
        """The code of each id (-1: the id has no chunk)."""
        if not self._code_of:
            self._code_of.update((name, k) for k, name in enumerate(self.names))
        get = self._code_of.get
        return np.fromiter((get(r, -1) for r in request_ids), np.int64, len(request_ids))

    def pooled(self, kind: str, request_ids) -> Pooled:
        """The gaps of `kind` over the requests `request_ids`."""
        codes = self.codes(request_ids)
        return self.pools[kind].select(codes[codes >= 0])

    def times(self, kind: str, request_ids) -> tuple[np.ndarray, np.ndarray]:
        """(first, last) chunk times of `kind` for each of `request_ids` (NaN: none)."""
        codes = self.codes(request_ids)
        first = np.full(codes.size, np.nan)
        last = np.full(codes.size, np.nan)
        has = codes >= 0
        first[has] = self.first_ns[kind][codes[has]]
        last[has] = self.last_ns[kind][codes[has]]
        return first, last

    def by_request(self, kind: str) -> dict[str, np.ndarray]:
        """An exact pool as `metrics.itl_ms_by_request` gives it: request id -> its gaps (ms),
        requests with no chunk of `kind` absent."""
        pool = self.pools[kind]
        has = ~np.isnan(self.first_ns[kind])
        return {self.names[c]: pool.gaps_of(c) for c in np.flatnonzero(has).tolist()}


def read_digest(run_dir, *, budget_bytes: float | None, **options) -> ChunkDigest:
    """The digest of a run directory's chunks (see `digest_chunks` for `options`)."""
    import pyarrow.parquet as pq

    from slo.runrecord import RunRecordError
    from slo.runrecord.reader import CHUNKS_FILE, table_files

    builder = _Builder(exact_gap_limit(budget_bytes), **options)
    code_of: dict[str, int] = {}
    carry = None
    try:
        for path in table_files(run_dir, CHUNKS_FILE):
            try:
                file = pq.ParquetFile(path, read_dictionary=[ChunkColumn.REQUEST_ID.value])
                batches = file.iter_batches(batch_size=BATCH_ROWS, columns=list(COLUMNS))
                for batch in batches:
                    ids = pa.chunked_array([batch.column(0)])
                    codes = metrics._codes(ids, builder.names, code_of)
                    rows = (codes, *metrics._count_columns(pa.Table.from_batches([batch])))
                    if carry is not None:
                        rows = tuple(np.concatenate(pair) for pair in zip(carry, rows, strict=True))
                    cut = _last_run_start(rows[0])
                    builder.feed(*(a[:cut] for a in rows))
                    carry = tuple(a[cut:] for a in rows)
            except (OSError, pa.ArrowException) as exc:
                raise RunRecordError(f"{path} is not a readable parquet file ({exc}).") from exc
        if carry is not None:
            builder.feed(*carry)
    except _NotGrouped:
        return digest_chunks(metrics.ChunkOrder.read(run_dir), budget_bytes=budget_bytes, **options)
    return builder.finish()


def digest_chunks(
    chunks: pa.Table | metrics.ChunkOrder, *, budget_bytes: float | None = None, **options
) -> ChunkDigest:
    """The digest of a chunks table (or order) in memory. `options`: `kinds` (the gap pools
    to keep besides `token`), `ok_ids` (the ok requests, for the tokens per chunk),
    `thresholds` (ms: each pool counts its gaps above each, exactly), `keep_token_rows`."""
    order = metrics.ChunkOrder.of(chunks)
    builder = _Builder(exact_gap_limit(budget_bytes), **options)
    builder.names.extend(order.names)
    builder.feed(order.codes, order.t_ns, order.n_tokens, order.n_chars)
    return builder.finish()


def _last_run_start(codes: np.ndarray) -> int:
    """Where the last request's run of rows starts (those rows may go on in the next batch)."""
    if codes.size == 0:
        return 0
    changes = np.flatnonzero(codes[1:] != codes[:-1])
    return int(changes[-1]) + 1 if changes.size else 0


class _Builder:
    def __init__(
        self,
        limit: int | None,
        *,
        kinds: tuple[str, ...] = (),
        ok_ids: set[str] | None = None,
        thresholds: tuple[float, ...] = (),
        keep_token_rows: bool = False,
    ) -> None:
        self.limit = limit
        self.names: list[str] = []
        self.next = 0  # the first code not fed yet
        self.pools = {TOKEN: GapPool(limit, tuple(thresholds))}
        self.content_same = CONTENT in kinds  # its pool is the token pool's while they agree
        self.through = GapPool(limit, tuple(thresholds)) if THROUGH_LAST_TOKEN in kinds else None
        self.times = {kind: ([], []) for kind in (TOKEN, CONTENT, ANY, THROUGH_LAST_TOKEN)}
        self.ok_ids = ok_ids
        self.ok_of = np.zeros(0, bool)
        self.ok_tokens = np.zeros(0, np.int64)
        self.rows: list | None = [] if keep_token_rows else None
        self.held_rows = 0

    def feed(self, codes, t_ns, n_tokens, n_chars) -> None:
        """Rows of whole requests, each request's rows together (else `_NotGrouped`)."""
        if codes.size == 0:
            return
        starts, _ = metrics.request_runs(codes)
        runs = codes[starts]
        low, high = self.next, int(runs.max()) + 1
        if int(runs.min()) < low or np.unique(runs).size != runs.size:
            raise _NotGrouped
        if not metrics._grouped_in_time_order(codes, t_ns, runs.size):  # time went back
            order = np.lexsort((t_ns, codes))
            codes, t_ns, n_tokens, n_chars = (a[order] for a in (codes, t_ns, n_tokens, n_chars))
        self.next = high
        width = high - low
        token = n_tokens > 0
        content = token | (n_chars > 0)
        self._times(ANY, codes, t_ns, None, low, width)
        self._times(TOKEN, codes, t_ns, token, low, width)
        self._times(CONTENT, codes, t_ns, content, low, width)
        if self.content_same and not np.array_equal(token, content):
            self.pools[CONTENT] = self.pools[TOKEN].copy()  # they part here
            self.content_same = False
        self._add(self.pools[TOKEN], codes, t_ns, token, low, width)
        if CONTENT in self.pools:
            self._add(self.pools[CONTENT], codes, t_ns, content, low, width)
        through = self._through_last_token(codes, token)
        self._times(THROUGH_LAST_TOKEN, codes, t_ns, through, low, width)
        if self.through is not None:
            self._add(self.through, codes, t_ns, through, low, width)
        self._tally(codes, n_tokens, token)
        if self.rows is not None:
            self._keep_rows(codes[token], t_ns[token], n_tokens[token])

    def _times(self, kind, codes, t_ns, keep, low, width) -> None:
        first, last = np.full(width, np.nan), np.full(width, np.nan)
        kept_codes = codes if keep is None else codes[keep]
        if kept_codes.size:
            kept_t = t_ns if keep is None else t_ns[keep]
            starts, ends = metrics.request_runs(kept_codes)
            at = kept_codes[starts] - low
            first[at] = kept_t[starts]
            last[at] = kept_t[ends - 1]
        self.times[kind][0].append(first)
        self.times[kind][1].append(last)

    @staticmethod
    def _add(pool: GapPool, codes, t_ns, keep, low, width) -> None:
        kept_codes, kept_t = codes[keep], t_ns[keep]
        same = kept_codes[1:] == kept_codes[:-1]
        gaps = np.subtract(kept_t[1:], kept_t[:-1], dtype=np.float64)[same]
        gaps /= metrics.NS_PER_MS
        pool.add(width, kept_codes[1:][same] - low, gaps)

    @staticmethod
    def _through_last_token(codes, token) -> np.ndarray:
        """Rows up to their request's last token-bearing row (rows grouped, time-ordered)."""
        position = np.arange(codes.size)
        last = np.full(codes.size, -1)
        rows = np.flatnonzero(token)
        if rows.size:
            tok_codes = codes[rows]
            _, ends = metrics.request_runs(tok_codes)
            starts, run_ends = metrics.request_runs(codes)
            run_of_code = dict(zip(codes[starts].tolist(), range(starts.size), strict=True))
            last_row = np.full(starts.size, -1)
            runs = np.fromiter((run_of_code[c] for c in tok_codes[ends - 1].tolist()), np.int64)
            last_row[runs] = rows[ends - 1]
            last = np.repeat(last_row, run_ends - starts)
        return position <= last

    def _tally(self, codes, n_tokens, token) -> None:
        if self.ok_ids is None:
            return
        if self.ok_of.size < len(self.names):
            new = [name in self.ok_ids for name in self.names[self.ok_of.size :]]
            self.ok_of = np.concatenate((self.ok_of, np.array(new, bool)))
        counted = n_tokens[token & self.ok_of[codes]]
        if counted.size:
            tally = np.bincount(counted)
            if tally.size > self.ok_tokens.size:
                self.ok_tokens = np.pad(self.ok_tokens, (0, tally.size - self.ok_tokens.size))
            self.ok_tokens[: tally.size] += tally

    def _keep_rows(self, codes, t_ns, n_tokens) -> None:
        self.held_rows += codes.size
        if self.limit is not None and self.held_rows > self.limit:
            self.rows = None  # over the budget: the peak in-flight set goes without
            return
        self.rows.append((codes, t_ns, n_tokens))

    def finish(self) -> ChunkDigest:
        n = len(self.names)
        if self.next < n:  # ids of a dictionary no row used
            width = n - self.next
            for firsts, lasts in self.times.values():
                firsts.append(np.full(width, np.nan))
                lasts.append(np.full(width, np.nan))
        pools = {TOKEN: self.pools[TOKEN].finish(n)}
        if CONTENT in self.pools:
            pools[CONTENT] = self.pools[CONTENT].finish(n)
        elif self.content_same:
            pools[CONTENT] = pools[TOKEN]
        if self.through is not None:
            pools[THROUGH_LAST_TOKEN] = self.through.finish(n)
        join = lambda parts: np.concatenate(parts) if parts else np.empty(0)  # noqa: E731
        rows = None
        if self.rows is not None:
            parts = list(zip(*self.rows, strict=True)) or ([], [], [])
            codes, t_ns, n_tokens = (
                metrics._concat(list(p), dtype)
                for p, dtype in zip(parts, (np.int32, np.int64, np.int32), strict=True)
            )
            rows = metrics.ChunkOrder(list(self.names), codes, t_ns, n_tokens, n_tokens * 0)
        return ChunkDigest(
            names=self.names,
            first_ns={kind: join(f) for kind, (f, _) in self.times.items()},
            last_ns={kind: join(last) for kind, (_, last) in self.times.items()},
            pools=pools,
            ok_tokens=self.ok_tokens,
            token_rows=rows,
        )
