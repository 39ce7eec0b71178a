"""Built workloads on disk: parquet with the manifest in the schema metadata, and the cache
under `<cache>/workloads/` keyed by a hash of everything that decides the table."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from workloads.schema import (
    REQUEST_SCHEMA,
    SHA256_ONE_BATCH,
    TableHasher,
    Workload,
    WorkloadError,
    table_sha256,
)

MANIFEST_KEY = b"workload_manifest"
ROW_GROUP_ROWS = 1024


class WorkloadWriter:
    """Writes a workload's rows to parquet in row groups of `ROW_GROUP_ROWS`, as they are
    built, so a build never holds its whole table. The manifest (JSON, sorted keys) goes in
    the file's key-value metadata at `close`; `hash_rows` computes the table's sha256 on the way
    (the batched form, `SHA256_BATCHED`). The file appears whole at `close` or not at all.
    Writing the same rows and manifest twice gives byte-identical files."""

    def __init__(self, path: Path, *, hash_rows: bool, schema_metadata: dict | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        schema = (
            REQUEST_SCHEMA.with_metadata(schema_metadata) if schema_metadata else REQUEST_SCHEMA
        )
        self._writer = pq.ParquetWriter(self._tmp, schema, compression="zstd", store_schema=True)
        self._hasher = TableHasher() if hash_rows else None
        self._pending = REQUEST_SCHEMA.empty_table()
        self.num_rows = 0

    def write(self, rows: pa.Table | pa.RecordBatch) -> None:
        """Append rows; full row groups go to disk, the rest waits (so row groups do not
        depend on how the rows were chunked)."""
        table = pa.Table.from_batches([rows]) if isinstance(rows, pa.RecordBatch) else rows
        table = table.cast(REQUEST_SCHEMA)
        if self._hasher is not None:
            self._hasher.update(table)
        self.num_rows += table.num_rows
        pending = pa.concat_tables([self._pending, table])
        full = pending.num_rows - pending.num_rows % ROW_GROUP_ROWS
        if full:
            self._writer.write_table(pending.slice(0, full), row_group_size=ROW_GROUP_ROWS)
        self._pending = pending.slice(full)

    def sha256(self) -> str:
        """The batched sha256 of every row written (call once, before `close`)."""
        if self._hasher is None:
            raise ValueError("this writer was opened without hash_rows")
        return self._hasher.hexdigest()

    def close(self, manifest: dict[str, Any]) -> None:
        if self._pending.num_rows:
            self._writer.write_table(self._pending)
        self._writer.add_key_value_metadata({MANIFEST_KEY: json.dumps(manifest, sort_keys=True)})
        self._writer.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._writer.close()
        self._tmp.unlink(missing_ok=True)


def write_parquet(workload: Workload, path: Path) -> None:
    """Write a built workload through `WorkloadWriter`, the manifest also in the schema
    metadata (as files written before streaming builds had it)."""
    meta = {MANIFEST_KEY: json.dumps(workload.manifest, sort_keys=True).encode()}
    writer = WorkloadWriter(path, hash_rows=False, schema_metadata=meta)
    try:
        writer.write(workload.table)
    except BaseException:
        writer.abort()
        raise
    writer.close(workload.manifest)


def read_parquet(path: Path) -> Workload:
    """Load a built workload; checks the schema and that the table matches its manifest sha256."""
    try:
        meta = pq.ParquetFile(path).metadata.metadata or {}
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise WorkloadError(f"Cannot read workload file {path} ({exc}).") from None
    meta = {**(table.schema.metadata or {}), **meta}
    if MANIFEST_KEY not in meta:
        raise WorkloadError(f"{path} is not a built workload (no manifest in its metadata).")
    manifest = json.loads(meta[MANIFEST_KEY])
    table = table.replace_schema_metadata(None)
    missing = [f.name for f in REQUEST_SCHEMA if f.name not in table.column_names]
    if missing and manifest.get("format_version", 1) < 3:
        raise WorkloadError(
            f"{path} was built by an older bench (no {', '.join(missing)} column); rebuild it "
            "with bench workload build."
        )
    if not table.schema.equals(REQUEST_SCHEMA):
        try:
            table = table.cast(REQUEST_SCHEMA)
        except (pa.ArrowInvalid, ValueError, pa.ArrowNotImplementedError):
            raise WorkloadError(f"{path} does not follow the RequestSpec schema.") from None
    digest = table_sha256(table, of=manifest.get("sha256_of", SHA256_ONE_BATCH))
    if digest != manifest.get("sha256"):
        raise WorkloadError(f"{path}: the table does not match the sha256 in its manifest.")
    return Workload(
        table=table,
        manifest=manifest,
        closed_loop_concurrency=manifest.get("closed_loop_concurrency"),
    )


def cache_key(parts: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of what decides a workload."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def file_identity(path: Path | None) -> dict[str, Any] | None:
    """Cheap identity of an input file for the cache key: path, size and mtime."""
    if path is None or not Path(path).is_file():
        return None
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
