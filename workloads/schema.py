"""The RequestSpec table (the `workloads` -> `harness` contract), the Workload result and errors."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

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
        pa.field("priority", pa.int32()),
        pa.field("deadline_s", pa.float64()),
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


def table_sha256(table: pa.Table) -> str:
    """sha256 (hex) of the table's canonical serialisation: the Arrow IPC stream of the table
    cast to `REQUEST_SCHEMA` (schema metadata dropped), written as one record batch."""
    canonical = table.cast(REQUEST_SCHEMA).replace_schema_metadata(None).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, REQUEST_SCHEMA) as writer:
        for batch in canonical.to_batches(max_chunksize=max(canonical.num_rows, 1)):
            writer.write_batch(batch)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()
