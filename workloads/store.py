"""Built workloads on disk: parquet with the manifest in the schema metadata, and the cache
under `<cache>/workloads/` keyed by a hash of everything that decides the table."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import platformdirs
import pyarrow as pa
import pyarrow.parquet as pq

from workloads.schema import REQUEST_SCHEMA, Workload, WorkloadError, table_sha256

MANIFEST_KEY = b"workload_manifest"


def cache_dir() -> Path:
    """`$BENCH_CACHE_DIR` if set, else `platformdirs.user_cache_dir("llm-bench")`."""
    env = os.environ.get("BENCH_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("llm-bench"))


def write_parquet(workload: Workload, path: Path) -> None:
    """Write the table with the manifest (JSON, sorted keys) in the schema metadata. Writing
    the same workload twice gives byte-identical files (no timestamps are stored)."""
    meta = {MANIFEST_KEY: json.dumps(workload.manifest, sort_keys=True).encode()}
    table = workload.table.replace_schema_metadata(meta)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    pq.write_table(table, tmp, compression="zstd", store_schema=True)
    os.replace(tmp, path)


def read_parquet(path: Path) -> Workload:
    """Load a built workload; checks the schema and that the table matches its manifest sha256."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise WorkloadError(f"Cannot read workload file {path} ({exc}).") from None
    meta = table.schema.metadata or {}
    if MANIFEST_KEY not in meta:
        raise WorkloadError(f"{path} is not a built workload (no manifest in its metadata).")
    manifest = json.loads(meta[MANIFEST_KEY])
    table = table.replace_schema_metadata(None)
    if not table.schema.equals(REQUEST_SCHEMA):
        try:
            table = table.cast(REQUEST_SCHEMA)
        except (pa.ArrowInvalid, ValueError, pa.ArrowNotImplementedError):
            raise WorkloadError(f"{path} does not follow the RequestSpec schema.") from None
    if table_sha256(table) != manifest.get("sha256"):
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
