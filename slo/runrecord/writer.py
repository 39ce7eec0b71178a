"""The incremental run-directory writer: the manifest first, then rows in parquet row groups.

The manifest is written at the start with `complete: false` and rewritten by `close`, so an
interrupted run is readable and says so. Every `append_*` call adds one row group; rows already
written survive a crash of the writer's process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from slo.runrecord.documents import RunManifest, RunSummary, write_json_atomic
from slo.runrecord.reader import (
    CHUNKS_FILE,
    MANIFEST_FILE,
    REQUESTS_FILE,
    SERVER_METRICS_FILE,
    SUMMARY_FILE,
    WARMUP_FILE,
)
from slo.runrecord.schema import (
    CHUNKS_SCHEMA,
    REQUESTS_SCHEMA,
    SERVER_METRICS_SCHEMA,
    RequestRecord,
    columns_table,
    requests_table,
)


@dataclass
class RunWriter:
    """Writes one run directory (which must exist). Not thread-safe; `close` is idempotent."""

    run_dir: Path
    manifest: RunManifest
    _writers: dict[str, pq.ParquetWriter] = field(default_factory=dict)
    _counts: dict[str, int] = field(default_factory=dict)
    closed: bool = False

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.manifest = self.manifest.evolve(complete=False)
        self.write_manifest()
        for name, schema in (
            (REQUESTS_FILE, REQUESTS_SCHEMA),
            (CHUNKS_FILE, CHUNKS_SCHEMA),
            (WARMUP_FILE, REQUESTS_SCHEMA),
        ):
            self._writers[name] = pq.ParquetWriter(self.run_dir / name, schema)
            self._counts[name] = 0

    def write_manifest(self) -> None:
        write_json_atomic(self.run_dir / MANIFEST_FILE, self.manifest.to_json())

    def update_manifest(self, **changes) -> None:
        """Apply `changes` to the manifest and rewrite it on disk."""
        self.manifest = self.manifest.evolve(**changes)
        self.write_manifest()

    def append_requests(self, records: list[RequestRecord]) -> None:
        """Append measured requests as one row group (validated: see `RequestRecord`)."""
        self._write(REQUESTS_FILE, requests_table(records))

    def append_warmup(self, records: list[RequestRecord]) -> None:
        self._write(WARMUP_FILE, requests_table(records))

    def append_chunks(self, rows: list[tuple[str, int, int, int]]) -> None:
        """Append `(request_id, t_ns, n_tokens, n_chars)` rows as one row group."""
        self._write(CHUNKS_FILE, columns_table(rows, CHUNKS_SCHEMA))

    def _write(self, name: str, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        self._writers[name].write_table(table)
        self._counts[name] += table.num_rows

    @property
    def num_requests(self) -> int:
        return self._counts[REQUESTS_FILE]

    def close(self, *, complete: bool, reason: str | None = None, **manifest_changes) -> None:
        """Close the tables and rewrite the manifest with the run's end state."""
        if self.closed:
            return
        try:
            for writer in self._writers.values():
                writer.close()
        finally:
            self.closed = True
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
