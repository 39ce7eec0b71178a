"""Opening a run directory: its tables and documents, as the contract defines them."""

from __future__ import annotations

import ctypes
import gc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from slo.runrecord.documents import RunManifest, RunSummary
from slo.runrecord.errors import RunRecordError
from slo.runrecord.schema import (
    CHUNKS_SCHEMA,
    REQUESTS_SCHEMA,
    SCHEDULE_SCHEMA,
    SERVER_METRICS_SCHEMA,
    RequestColumn,
)

MANIFEST_FILE = "manifest.json"
SUMMARY_FILE = "summary.json"
REQUESTS_FILE = "requests.parquet"
WARMUP_FILE = "warmup.parquet"
CHUNKS_FILE = "chunks.parquet"
SERVER_METRICS_FILE = "server_metrics.parquet"
SCHEDULE_FILE = "schedule.parquet"
PARTS_DIR = ".parts"  # a writer's row groups until it closes (see `RunWriter`)


@dataclass(frozen=True)
class RunTables:
    """The tables of one run directory, as read from disk.

    `chunks`, `warmup`, `server_metrics` and `schedule` are empty tables with the contract's
    columns when the run has no such file; `manifest` is None when it has no `manifest.json`.
    """

    requests: pa.Table
    chunks: pa.Table
    manifest: RunManifest | None = None
    warmup: pa.Table = field(default_factory=REQUESTS_SCHEMA.empty_table)
    server_metrics: pa.Table = field(default_factory=SERVER_METRICS_SCHEMA.empty_table)
    schedule: pa.Table = field(default_factory=SCHEDULE_SCHEMA.empty_table)


def part_paths(run_dir: Path, name: str) -> list[Path]:
    """The parts a writer left for table file `name`, in the order they were written."""
    stem = name.removesuffix(".parquet")
    return sorted((Path(run_dir) / PARTS_DIR).glob(f"{stem}-*.parquet"))


def _read_table(path: Path, empty: pa.Schema | None, columns: list[str] | None = None) -> pa.Table:
    """The table at `path` (or its writer's parts); with `columns`, those of them it has."""
    parts = part_paths(path.parent, path.name)
    if parts:  # the writer has not closed (still running, or it died): read what it wrote
        try:
            tables = [
                pq.read_table(
                    p, use_threads=False, columns=_present(pq.read_schema(p).names, columns)
                )
                for p in parts
            ]
        except (OSError, pa.ArrowException) as exc:
            raise RunRecordError(f"{parts[0].parent} holds an unreadable part ({exc}).") from exc
        return pa.concat_tables(tables)
    if not path.is_file():
        if (path.parent / PARTS_DIR).is_dir():  # a writer started but wrote no row yet
            return (empty or REQUESTS_SCHEMA).empty_table()
        if empty is None:
            raise RunRecordError(
                f"{path.parent} has no {path.name}; pass a run directory written by bench."
            )
        return empty.empty_table()
    try:
        # One thread: Arrow's threaded read of a run's many small row groups left 3 KB a
        # request of heap behind (and was no faster: 0.13 s against 0.31 s for 30,000 rows).
        # A row group at a time: `read_table` peaked at 44 MB above the start for the 12 MB
        # requests table of 30,000 requests (30 MB for 15,000), this at 25 (19).
        with pq.ParquetFile(path) as file:
            names = _present(file.schema_arrow.names, columns)
            groups = [
                file.read_row_group(i, columns=names, use_threads=False)
                for i in range(file.num_row_groups)
            ]
            return pa.concat_tables(groups) if groups else file.schema_arrow.empty_table()
    except (OSError, pa.ArrowException) as exc:
        raise RunRecordError(f"{path} is not a readable parquet file ({exc}).") from exc


def _present(names: list[str], columns: list[str] | None) -> list[str] | None:
    """The `columns` a table with these column `names` has (None: all of them)."""
    return None if columns is None else [c for c in columns if c in names]


def table_files(run_dir: Path | str, name: str) -> list[Path]:
    """The files that hold table `name` of a run, as `open_run` reads them: the writer's parts
    while it has not closed, else the table's file; none when the run has no such table."""
    parts = part_paths(Path(run_dir), name)
    if parts:
        return parts
    path = Path(run_dir) / name
    return [path] if path.is_file() else []


def open_run(
    run_dir: Path | str, *, chunks: bool = True, columns: list[str] | None = None
) -> RunTables:
    """Read a run directory written by `RunWriter`; with `chunks=False` its chunks table is
    left on disk (an empty table stands for it: see `slo.metrics.ChunkOrder.read`). With
    `columns`, `requests` holds only those of its columns (the ones the file has).

    Raises `RunRecordError` when the directory or its `requests.parquet` is missing or
    unreadable, or its manifest has an unknown schema version. Warm-up rows (`is_warmup` true),
    if a writer left any in `requests.parquet`, are dropped.
    """
    run_dir = Path(run_dir)
    if columns is not None:  # what identifying and filtering the rows takes, too
        extra = [RequestColumn.REQUEST_ID.value, RequestColumn.IS_WARMUP.value]
        columns = list(dict.fromkeys(str(c) for c in [*columns, *extra]))
    requests = _read_table(run_dir / REQUESTS_FILE, None, columns)
    if RequestColumn.REQUEST_ID not in requests.column_names:
        raise RunRecordError(
            f"{run_dir / REQUESTS_FILE} has no {RequestColumn.REQUEST_ID.value} column; "
            "it does not follow the contract."
        )
    if RequestColumn.IS_WARMUP in requests.column_names:
        warm = pc.fill_null(requests[RequestColumn.IS_WARMUP], False)
        if pc.any(warm).as_py():  # a filter copies the whole table, beside the one read
            requests = requests.filter(pc.invert(warm))
    manifest_path = run_dir / MANIFEST_FILE
    tables = RunTables(
        requests=requests,
        chunks=(
            _read_table(run_dir / CHUNKS_FILE, CHUNKS_SCHEMA)
            if chunks
            else CHUNKS_SCHEMA.empty_table()
        ),
        manifest=read_manifest(run_dir) if manifest_path.is_file() else None,
        warmup=_read_table(run_dir / WARMUP_FILE, REQUESTS_SCHEMA),
        server_metrics=_read_table(run_dir / SERVER_METRICS_FILE, SERVER_METRICS_SCHEMA),
        schedule=_read_table(run_dir / SCHEDULE_FILE, SCHEDULE_SCHEMA),
    )
    release_free_memory(collect=False)
    return tables


def release_free_memory(*, collect: bool = True) -> None:
    """Hand back to the system what was freed, glibc's malloc and Arrow's pool keeping it
    otherwise. Reading a run's `requests.parquet` leaves 1-3 KB a request of freed heap
    behind, beyond the table itself: a summary of 30,000 requests peaked 45 MB above one of
    15,000 with it kept, 18 MB with it given back (issue "Runs that last", measured when the
    writer still wrote a row group per flush). No-op where glibc is not the allocator.
    `collect` runs the garbage collector first (about 0.1 s in a process of many objects: not
    after every read, which made `bench history add` of 30 runs 2.6 times slower)."""
    if collect:
        gc.collect()
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def read_manifest(run_dir: Path | str) -> RunManifest:
    """`manifest.json` of `run_dir`; RunRecordError when missing, not JSON or of another version."""
    path = Path(run_dir) / MANIFEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise RunRecordError(
            f"{run_dir} has no {MANIFEST_FILE}; pass a run directory written by bench."
        ) from exc
    except OSError as exc:
        raise RunRecordError(f"cannot read {path} ({exc.strerror or exc}).") from exc
    return RunManifest.from_json(text, what=str(path))


def read_summary(run_dir: Path | str) -> RunSummary:
    """`summary.json` of `run_dir`; RunRecordError when missing, not JSON or of another version."""
    path = Path(run_dir) / SUMMARY_FILE
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise RunRecordError(f"{run_dir} has no {SUMMARY_FILE}; run `bench report` on it.") from exc
    return RunSummary.from_json(text, what=str(path))


def float_column(table: pa.Table, name: str) -> np.ndarray:
    """Column `name` as float64 with NaN for nulls; all-NaN when the column is absent."""
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan)
    column = pc.cast(table[name], pa.float64())
    return np.asarray(pc.fill_null(column, np.nan).to_numpy(zero_copy_only=False), dtype=np.float64)


def string_column(table: pa.Table, name: str) -> np.ndarray:
    """Column `name` as an object array of str, with None for nulls (all None when absent)."""
    if name not in table.column_names:
        return np.full(table.num_rows, None, dtype=object)
    return np.asarray(table[name].to_pylist(), dtype=object)
