"""The RequestSpec table (the `workloads` -> `harness` contract), the Workload result and errors."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

REQUEST_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("arrival_s", pa.float64()),
        pa.field("prompt", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
        pa.field("input_tokens", pa.int32(), nullable=False),
        pa.field("max_output_tokens", pa.int32(), nullable=False),
        pa.field("ignore_eos", pa.bool_(), nullable=False),
        pa.field("temperature", pa.float32()),
        pa.field("top_p", pa.float32()),
        pa.field("seed", pa.int64()),
        pa.field("prefix_group", pa.string()),
        pa.field("session_id", pa.string()),
        pa.field("turn_index", pa.int32()),
        pa.field("think_s", pa.float64()),
        pa.field("priority", pa.int32()),
        pa.field("deadline_ms", pa.int32()),
        pa.field("tenant", pa.string()),
    ]
)


class WorkloadError(Exception):
    """A user-caused workload problem (bad spec, unknown name, malformed file); one sentence."""


@dataclass(frozen=True)
class Workload:
    """A materialised workload.

    `table` follows `REQUEST_SCHEMA` exactly; `manifest` records generator, parameters, seed,
    tokenizer, `sha256` of the table, `synthetic` and `source`; `closed_loop_concurrency` is set
    (and every `arrival_s` is null) for closed-loop workloads, else None.
    """

    table: pa.Table
    manifest: dict[str, Any] = field(default_factory=dict)
    closed_loop_concurrency: int | None = None

    def __post_init__(self) -> None:
        if not self.table.schema.remove_metadata().equals(REQUEST_SCHEMA):
            raise ValueError("Workload.table does not follow workloads.REQUEST_SCHEMA")
        if self.closed_loop_concurrency is not None and self.closed_loop_concurrency < 1:
            raise ValueError("closed_loop_concurrency must be >= 1")

    @property
    def num_requests(self) -> int:
        return self.table.num_rows


SHA256_ONE_BATCH = "Arrow IPC stream of the table cast to REQUEST_SCHEMA, one record batch"
SHA256_BATCH_ROWS = 1024
SHA256_BATCHED = f"Arrow IPC stream of the table cast to REQUEST_SCHEMA, record batches of {SHA256_BATCH_ROWS} rows"


class _HashSink:
    """A write-only file that only feeds a sha256 (for `pa.PythonFile`)."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.closed = False

    def write(self, data) -> int:
        self.digest.update(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class TableHasher:
    """`table_sha256` in the batched form, fed one record batch at a time (any sizes: rows are
    regrouped into batches of `SHA256_BATCH_ROWS`), so a streaming build never holds its table."""

    def __init__(self) -> None:
        self._sink = _HashSink()
        self._writer = pa.ipc.new_stream(pa.PythonFile(self._sink, mode="w"), REQUEST_SCHEMA)
        self._pending = REQUEST_SCHEMA.empty_table()

    def update(self, batch: pa.RecordBatch | pa.Table) -> None:
        table = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
        table = table.cast(REQUEST_SCHEMA).replace_schema_metadata(None)
        pending = pa.concat_tables([self._pending, table])
        offset = 0
        while pending.num_rows - offset >= SHA256_BATCH_ROWS:
            self._write(pending.slice(offset, SHA256_BATCH_ROWS))
            offset += SHA256_BATCH_ROWS
        self._pending = pending.slice(offset)

    def _write(self, rows: pa.Table) -> None:
        # concat_arrays copies each column into fresh buffers: a slice's validity bitmap can
        # carry stray bits past its end, which the IPC bytes (and so the digest) would keep
        arrays = [_zero_null_slots(pa.concat_arrays(column.chunks)) for column in rows.columns]
        self._writer.write_batch(pa.record_batch(arrays, schema=REQUEST_SCHEMA))

    def hexdigest(self) -> str:
        if self._pending.num_rows:
            self._write(self._pending)
        self._writer.close()
        return self._sink.digest.hexdigest()


def _zero_null_slots(array: pa.Array) -> pa.Array:
    """A numeric array with zero in its null slots. What a null slot holds is no data, and a
    parquet round trip may fill it with anything (an int column's dictionary's first value),
    so the digest must not see it."""
    if array.null_count == 0 or not (
        pa.types.is_integer(array.type) or pa.types.is_floating(array.type)
    ):
        return array
    if array.offset:  # the callers pass concatenated arrays (offset 0) already
        array = pa.concat_arrays([array])
    values = pc.fill_null(array, pa.scalar(0, array.type))
    validity = array.buffers()[0]
    return pa.Array.from_buffers(
        array.type, len(array), [validity, values.buffers()[1]], array.null_count
    )


def table_sha256(table: pa.Table, *, of: str = SHA256_ONE_BATCH) -> str:
    """sha256 (hex) of the table's canonical serialisation: the Arrow IPC stream of the table
    cast to `REQUEST_SCHEMA` (schema metadata dropped), written as one record batch
    (`SHA256_ONE_BATCH`, in-memory builds) or in batches of `SHA256_BATCH_ROWS` rows
    (`SHA256_BATCHED`, streaming builds). `of` is the manifest's `sha256_of`."""
    if of == SHA256_BATCHED:
        hasher = TableHasher()
        hasher.update(table)
        return hasher.hexdigest()
    if of != SHA256_ONE_BATCH:
        raise WorkloadError(f"Unknown table digest {of!r}; rebuild the workload.")
    canonical = table.cast(REQUEST_SCHEMA).replace_schema_metadata(None).combine_chunks()
    canonical = pa.Table.from_arrays(
        [_zero_null_slots(pa.concat_arrays(c.chunks)) for c in canonical.columns],
        schema=REQUEST_SCHEMA,
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, REQUEST_SCHEMA) as writer:
        for batch in canonical.to_batches(max_chunksize=max(canonical.num_rows, 1)):
            writer.write_batch(batch)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()
