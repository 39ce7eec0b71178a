"""Reading a run directory's tables (the only I/O `slo` does besides loading SLO specs).

The schema is pinned in docs/CONTRACTS.md: `requests.parquet` (one row per request),
`chunks.parquet` (one row per received stream chunk) and `manifest.json`. Times are int64
nanoseconds relative to the run's `t0_ns`; a null time means the event never happened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from slo.errors import SLOError

REQUEST_TIME_COLUMNS = (
    "t_scheduled_ns",
    "t_sent_ns",
    "t_first_byte_ns",
    "t_first_token_ns",
    "t_last_token_ns",
    "t_done_ns",
)

REQUESTS_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("t_scheduled_ns", pa.int64()),
        ("t_sent_ns", pa.int64()),
        ("t_first_byte_ns", pa.int64()),
        ("t_first_token_ns", pa.int64()),
        ("t_last_token_ns", pa.int64()),
        ("t_done_ns", pa.int64()),
        ("status", pa.string()),
        ("http_status", pa.int32()),
        ("error_class", pa.string()),
        ("error_message", pa.string()),
        ("finish_reason", pa.string()),
        ("input_tokens", pa.int32()),
        ("usage_prompt_tokens", pa.int32()),
        ("usage_completion_tokens", pa.int32()),
        ("client_output_tokens", pa.int32()),
        ("output_tokens", pa.int32()),
        ("output_tokens_source", pa.string()),
        ("output_chars", pa.int32()),
        ("output_sha256", pa.string()),
        ("num_chunks", pa.int32()),
        ("is_warmup", pa.bool_()),
    ]
)
"""The columns of `requests.parquet` (and `warmup.parquet`), as docs/CONTRACTS.md pins them;
the harness writes exactly this schema."""

CHUNKS_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("t_ns", pa.int64()),
        ("n_tokens", pa.int32()),
        ("n_chars", pa.int32()),
    ]
)


@dataclass(frozen=True)
class RunTables:
    """The tables of one run directory, as read from disk.

    `chunks` is an empty table with the contract's columns when the run has no
    `chunks.parquet`; `manifest` is `{}` when it has no `manifest.json`.
    """

    requests: pa.Table
    chunks: pa.Table
    manifest: dict = field(default_factory=dict)


def load_run(run_dir: Path | str) -> RunTables:
    """Read `requests.parquet`, `chunks.parquet` and `manifest.json` from `run_dir`.

    Raises `SLOError` when the directory or its `requests.parquet` is missing or unreadable.
    Warm-up rows (`is_warmup` true), if a writer left any in `requests.parquet`, are dropped.
    """
    run_dir = Path(run_dir)
    requests_path = run_dir / "requests.parquet"
    if not requests_path.is_file():
        raise SLOError(f"{run_dir} has no requests.parquet; pass a run directory written by bench.")
    try:
        requests = pq.read_table(requests_path)
    except (OSError, pa.ArrowException) as exc:
        raise SLOError(f"{requests_path} is not a readable parquet file ({exc}).") from exc
    if "request_id" not in requests.column_names:
        raise SLOError(
            f"{requests_path} has no request_id column; it does not follow the contract."
        )
    if "is_warmup" in requests.column_names:
        requests = requests.filter(pc.invert(pc.fill_null(requests["is_warmup"], False)))

    chunks_path = run_dir / "chunks.parquet"
    if chunks_path.is_file():
        try:
            chunks = pq.read_table(chunks_path)
        except (OSError, pa.ArrowException) as exc:
            raise SLOError(f"{chunks_path} is not a readable parquet file ({exc}).") from exc
    else:
        chunks = CHUNKS_SCHEMA.empty_table()

    manifest_path = run_dir / "manifest.json"
    manifest: dict = {}
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as exc:
            raise SLOError(f"{manifest_path} is not valid JSON ({exc}).") from exc
    return RunTables(requests=requests, chunks=chunks, manifest=manifest)


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
