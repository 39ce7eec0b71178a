"""The RequestSpec table of a build, as Arrow record batches: one batch per chunk of prompts,
each column as `workloads.schema.REQUEST_SCHEMA` has it."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from workloads.classes import ClassColumns
from workloads.prompts import Prompt
from workloads.schema import REQUEST_SCHEMA
from workloads.sources import Rows, SessionColumns


def record_batches(
    rows: Rows,
    *,
    ignore_eos: bool,
    temperature: float | None,
    top_p: float | None,
    classes: ClassColumns | None = None,
) -> Iterator[pa.RecordBatch]:
    """The table of `rows`, a batch per chunk of `rows.prompts` (which it consumes); every
    request gets `ignore_eos`, `temperature` and `top_p` (None: the server's default), and
    its tenant, priority and deadline from `classes` (None: no request has any)."""
    classes = classes or ClassColumns(tenant=None, priority=None, deadline_ms=None)
    start = 0
    for prompts, groups in rows.prompts:
        yield _batch(rows, start, prompts, groups, ignore_eos, temperature, top_p, classes)
        start += len(prompts)


def _batch(
    rows: Rows,
    start: int,
    prompts: list[Prompt],
    groups: list[str | None] | None,
    ignore_eos: bool,
    temperature: float | None,
    top_p: float | None,
    classes: ClassColumns,
) -> pa.RecordBatch:
    """Rows `start .. start + len(prompts)` of the table."""
    n = len(prompts)
    stop = start + n
    width = max(6, len(str(len(rows.ins) - 1)))
    lengths = [len(p.token_ids) for p in prompts]
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = (
        np.concatenate([p.token_ids for p in prompts]).astype(np.int32)
        if n
        else np.empty(0, dtype=np.int32)
    )
    ids_col = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, pa.int32()))
    times = rows.times
    columns = {
        "request_id": pa.array([f"req-{i:0{width}d}" for i in range(start, stop)], pa.string()),
        "arrival_s": pa.nulls(n, pa.float64()) if times is None else _floats(times[start:stop]),
        "prompt": pa.array([p.text for p in prompts], pa.string()),
        "prompt_token_ids": ids_col,
        "input_tokens": pa.array(np.asarray(lengths, dtype=np.int32), pa.int32()),
        "max_output_tokens": pa.array(
            np.maximum(np.asarray(rows.outs[start:stop]), 1).astype(np.int32), pa.int32()
        ),
        "ignore_eos": pa.array(np.full(n, ignore_eos), pa.bool_()),
        "temperature": pa.array([temperature] * n, pa.float32()),
        "top_p": pa.array([top_p] * n, pa.float32()),
        "seed": pa.nulls(n, pa.int64()),
        "prefix_group": pa.array(groups if groups is not None else [None] * n, pa.string()),
        **_session_columns(rows.sessions, start, stop),
        "priority": _ints(classes.priority, start, stop),
        "deadline_ms": _ints(classes.deadline_ms, start, stop),
        "tenant": pa.nulls(n, pa.string())
        if classes.tenant is None
        else pa.array(classes.tenant[start:stop], pa.string()),
    }
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=REQUEST_SCHEMA)


def _session_columns(sessions: SessionColumns | None, start: int, stop: int) -> dict:
    n = stop - start
    if sessions is None:
        return {
            "session_id": pa.nulls(n, pa.string()),
            "turn_index": pa.nulls(n, pa.int32()),
            "think_s": pa.nulls(n, pa.float64()),
        }
    return {
        "session_id": pa.array(sessions.session_id[start:stop], pa.string()),
        "turn_index": pa.array(sessions.turn_index[start:stop], pa.int32()),
        "think_s": _floats(sessions.think_s[start:stop]),
    }


def _ints(values: np.ndarray | None, start: int, stop: int) -> pa.Array:
    """int32 with NaN as null (the null slots zero, as `_floats` keeps them)."""
    if values is None:
        return pa.nulls(stop - start, pa.int32())
    part = np.asarray(values[start:stop], dtype=np.float64)
    missing = np.isnan(part)
    return pa.array(np.where(missing, 0, part).astype(np.int32), pa.int32(), mask=missing)


def _floats(values: np.ndarray) -> pa.Array:
    """float64 with NaN as null, the null slots zero (as a parquet round trip leaves them, so
    the table's sha256 survives one)."""
    values = np.asarray(values, dtype=np.float64)
    missing = np.isnan(values)
    return pa.array(np.where(missing, 0.0, values), pa.float64(), mask=missing)
