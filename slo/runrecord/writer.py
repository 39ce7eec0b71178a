"""The incremental run-directory writer: the manifest first, then rows in parquet parts.

The manifest is written at the start with `complete: false` and rewritten by `close`, so an
interrupted run says so. Every `append_*` call writes one small, complete parquet file under
`.parts/` (a parquet file is unreadable until its footer is written, so one long-open file would
lose everything to a crash); `close` streams the parts of each table into its final file, consecutive
parts joined into row groups of about `ROW_GROUP_BYTES`, and removes them. A run whose writer died keeps its parts, and `open_run`
reads them, so every row appended before a crash, even a SIGKILL, is still there.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from slo.runrecord.documents import RunManifest, RunSummary, write_json_atomic
from slo.runrecord.reader import (
    CHUNKS_FILE,
    MANIFEST_FILE,
    PARTS_DIR,
    REQUESTS_FILE,
    SCHEDULE_FILE,
    SERVER_METRICS_FILE,
    SUMMARY_FILE,
    WARMUP_FILE,
    part_paths,
)
from slo.runrecord.schema import (
    CHUNKS_SCHEMA,
    REQUESTS_SCHEMA,
    SCHEDULE_SCHEMA,
    SERVER_METRICS_SCHEMA,
    RequestRecord,
    columns_table,
    requests_table,
)

# A row group per part (a flush every few seconds) gave a 30,000-request run 220 row groups of
# 51 columns: 11,000 column chunks whose footer metadata took 17 MB to read, and a reader 47 MB
# of heap beside an 11 MB table; joined to ~8 MB groups that run has 2 (issue "Runs that last").
ROW_GROUP_BYTES = 8 << 20
_TABLES = (
    (REQUESTS_FILE, REQUESTS_SCHEMA),
    (CHUNKS_FILE, CHUNKS_SCHEMA),
    (WARMUP_FILE, REQUESTS_SCHEMA),
)


@dataclass
class RunWriter:
    """Writes one run directory (which must exist). Not thread-safe; `close` is idempotent."""

    run_dir: Path
    manifest: RunManifest
    _counts: dict[str, int] = field(default_factory=dict)
    _parts: dict[str, int] = field(default_factory=dict)
    closed: bool = False

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        (self.run_dir / PARTS_DIR).mkdir(exist_ok=True)
        self.manifest = self.manifest.evolve(complete=False)
        self.write_manifest()
        for name, _ in _TABLES:
            self._counts[name] = 0
            self._parts[name] = 0

    def write_manifest(self) -> None:
        write_json_atomic(self.run_dir / MANIFEST_FILE, self.manifest.to_json())

    def update_manifest(self, **changes) -> None:
        """Apply `changes` to the manifest and rewrite it on disk."""
        self.manifest = self.manifest.evolve(**changes)
        self.write_manifest()

    def write_schedule(self, rows: list[tuple[str, float | None, bool]]) -> None:
        """Record every request the run means to send, `(request_id, arrival_s, is_warmup)`,
        before the first is sent: the ledger proves each got exactly one row."""
        pq.write_table(columns_table(rows, SCHEDULE_SCHEMA), self.run_dir / SCHEDULE_FILE)

    def append_requests(self, records: list[RequestRecord]) -> None:
        """Append measured requests (validated: see `RequestRecord`)."""
        self._write(REQUESTS_FILE, requests_table(records))

    def append_warmup(self, records: list[RequestRecord]) -> None:
        self._write(WARMUP_FILE, requests_table(records))

    def append_chunks(self, rows: list[tuple]) -> None:
        """Append `(request_id, t_ns, n_tokens, n_chars)` rows, each optionally followed by
        its `reasoning` marker (left out: null)."""
        self._write(CHUNKS_FILE, columns_table(rows, CHUNKS_SCHEMA))

    def append_chunk_columns(
        self,
        request_ids: list[str],
        counts: np.ndarray,
        t_ns: np.ndarray,
        n_tokens: np.ndarray,
        n_chars: np.ndarray,
        reasoning: np.ndarray | None = None,
    ) -> None:
        """Append chunk rows given as columns: `request_ids[i]` owns the next `counts[i]`
        entries of `t_ns`, `n_tokens`, `n_chars` and `reasoning` (bool; None: every marker
        null), the same rows as `append_chunks`."""
        if int(np.sum(counts)) != len(t_ns) or not len(t_ns) == len(n_tokens) == len(n_chars):
            raise ValueError("chunk columns differ in length from the rows they are said to hold")
        owners = np.repeat(np.arange(len(request_ids), dtype=np.int64), counts)
        if reasoning is not None and len(reasoning) != len(t_ns):
            raise ValueError("chunk columns differ in length from the rows they are said to hold")
        marks = pa.nulls(len(t_ns), pa.bool_()) if reasoning is None else reasoning
        columns = [pa.array(request_ids, pa.string()).take(owners), t_ns, n_tokens, n_chars, marks]
        arrays = [pa.array(c, type=f.type) for c, f in zip(columns, CHUNKS_SCHEMA, strict=True)]
        self._write(CHUNKS_FILE, pa.Table.from_arrays(arrays, schema=CHUNKS_SCHEMA))

    def _write(self, name: str, table: pa.Table) -> None:
        if self.closed:
            raise ValueError("the run writer is closed")
        if table.num_rows == 0:
            return
        self._parts[name] += 1
        stem = name.removesuffix(".parquet")
        final = self.run_dir / PARTS_DIR / f"{stem}-{self._parts[name]:06d}.parquet"
        tmp = final.with_suffix(".tmp")
        pq.write_table(table, tmp)
        tmp.replace(final)  # a part is either whole or absent
        self._counts[name] += table.num_rows

    @property
    def num_requests(self) -> int:
        return self._counts[REQUESTS_FILE]

    def close(self, *, complete: bool, reason: str | None = None, **manifest_changes) -> None:
        """Merge the parts into the final tables and rewrite the manifest with the end state."""
        if self.closed:
            return
        self.closed = True
        try:
            for name, schema in _TABLES:
                with pq.ParquetWriter(self.run_dir / name, schema) as out:
                    pending: list[pa.Table] = []
                    for part in part_paths(self.run_dir, name):
                        pending.append(pq.read_table(part))
                        if sum(t.nbytes for t in pending) >= ROW_GROUP_BYTES:
                            out.write_table(pa.concat_tables(pending))
                            pending = []
                    if pending:
                        out.write_table(pa.concat_tables(pending))
            shutil.rmtree(self.run_dir / PARTS_DIR, ignore_errors=True)
        finally:
            self.update_manifest(
                complete=complete,
                interrupted_reason=reason,
                ended_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                num_requests_recorded=self._counts[REQUESTS_FILE],
                num_warmup_recorded=self._counts[WARMUP_FILE],
                **manifest_changes,
            )


def write_server_metrics(run_dir: Path, rows: list[tuple[int, str, str, float]]) -> int:
    """Write `server_metrics.parquet` from `(t_ns, name, labels, value)` rows when there are any;
    returns the row count."""
    if not rows:
        return 0
    pq.write_table(columns_table(rows, SERVER_METRICS_SCHEMA), Path(run_dir) / SERVER_METRICS_FILE)
    return len(rows)


def write_summary(run_dir: Path, summary: RunSummary) -> None:
    write_json_atomic(Path(run_dir) / SUMMARY_FILE, summary.to_json())
