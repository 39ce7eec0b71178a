"""The run directory writer: manifest first, then request and chunk rows in row groups.

Rows are parsed and written in batches (`flush`), off the per-read hot path. The manifest is
written at the start with `complete: false` and rewritten at the end, so an interrupted run is
readable and says so.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from harness.client import RawResult
from harness.errors import HarnessError
from harness.records import RecordContext, to_rows
from slo.run_tables import CHUNKS_SCHEMA, REQUESTS_SCHEMA

MANIFEST_SCHEMA_VERSION = 1


def prepare_run_dir(path: Path) -> Path:
    """Create an empty run directory; refuse one that already holds a run or is unwritable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise HarnessError(f"--out {path} is a file, not a directory; choose another --out.")
    if path.is_dir() and any(path.iterdir()):
        raise HarnessError(
            f"--out {path} already holds files; choose an empty or new directory so nothing recorded is overwritten."
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise HarnessError(
            f"cannot write the run directory {path}: {exc.strerror or exc}."
        ) from exc
    return path


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write JSON through a temporary file and a rename, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


@dataclass
class RunRecorder:
    """Accumulates raw results and writes them to `requests.parquet` / `chunks.parquet`."""

    run_dir: Path
    context: RecordContext
    input_tokens: dict[str, int]
    manifest: dict
    _pending: list[RawResult] = field(default_factory=list)
    _writers: dict[str, pq.ParquetWriter] = field(default_factory=dict)
    _counts: dict[str, int] = field(default_factory=dict)
    closed: bool = False

    def __post_init__(self) -> None:
        self.manifest.update(schema_version=MANIFEST_SCHEMA_VERSION, complete=False)
        write_json_atomic(self.run_dir / "manifest.json", self.manifest)
        for name, schema in (
            ("requests", REQUESTS_SCHEMA),
            ("chunks", CHUNKS_SCHEMA),
            ("warmup", REQUESTS_SCHEMA),
        ):
            self._writers[name] = pq.ParquetWriter(self.run_dir / f"{name}.parquet", schema)
            self._counts[name] = 0

    def add(self, raw: RawResult) -> None:
        """Keep a finished request's raw timeline until the next flush (cheap: no parsing)."""
        self._pending.append(raw)

    def flush(self) -> None:
        """Parse pending results and append them as one row group per table."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        rows, warm_rows, chunk_rows = [], [], []
        for raw in pending:
            row, chunks = to_rows(raw, self.input_tokens.get(raw.request_id), self.context)
            if raw.is_warmup:
                warm_rows.append(row)
            else:
                rows.append(row)
                chunk_rows.extend(chunks)
        self._write(
            "requests",
            REQUESTS_SCHEMA,
            pa.Table.from_pylist(rows, REQUESTS_SCHEMA) if rows else None,
        )
        self._write(
            "warmup",
            REQUESTS_SCHEMA,
            pa.Table.from_pylist(warm_rows, REQUESTS_SCHEMA) if warm_rows else None,
        )
        if chunk_rows:
            columns = list(zip(*chunk_rows, strict=True))
            table = pa.Table.from_arrays(
                [pa.array(c, type=f.type) for c, f in zip(columns, CHUNKS_SCHEMA, strict=True)],
                schema=CHUNKS_SCHEMA,
            )
            self._write("chunks", CHUNKS_SCHEMA, table)

    def _write(self, name: str, schema: pa.Schema, table: pa.Table | None) -> None:
        if table is None or table.num_rows == 0:
            return
        self._writers[name].write_table(table)
        self._counts[name] += table.num_rows

    def close(
        self, *, complete: bool, reason: str | None = None, extra: dict | None = None
    ) -> None:
        """Flush, close the tables and rewrite the manifest with the run's end state. Idempotent."""
        if self.closed:
            return
        try:
            self.flush()
        finally:
            for writer in self._writers.values():
                writer.close()
            self.closed = True
            self.manifest.update(
                complete=complete,
                interrupted_reason=reason,
                ended_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                num_requests_recorded=self._counts["requests"],
                num_warmup_recorded=self._counts["warmup"],
                **(extra or {}),
            )
            write_json_atomic(self.run_dir / "manifest.json", self.manifest)
