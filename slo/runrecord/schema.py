"""The Arrow schemas of a run directory's tables, their column names, and typed rows.

`requests.parquet` and `warmup.parquet` share `REQUESTS_SCHEMA` (one row per request),
`chunks.parquet` has one row per received stream event, `server_metrics.parquet` one row per
scraped Prometheus sample. Times are int64 nanoseconds relative to the manifest's `t0_ns`; a null
time means the event never happened. The column names are members of the `*Column` enums; code
outside this module names columns only through them.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from enum import StrEnum

import pyarrow as pa

from slo.runrecord.enums import ErrorClass, RequestStatus, TokenSource
from slo.runrecord.errors import RunRecordError


class RequestColumn(StrEnum):
    """Columns of `requests.parquet` / `warmup.parquet`, in file order."""

    REQUEST_ID = "request_id"
    T_SCHEDULED_NS = "t_scheduled_ns"  # when the schedule said to send it
    T_SENT_NS = "t_sent_ns"  # just before the request was written
    T_FIRST_BYTE_NS = "t_first_byte_ns"  # response headers received
    T_FIRST_TOKEN_NS = "t_first_token_ns"  # first token-bearing chunk
    T_LAST_TOKEN_NS = "t_last_token_ns"
    T_DONE_NS = "t_done_ns"  # the request's terminal event
    STATUS = "status"  # a RequestStatus
    HTTP_STATUS = "http_status"
    ERROR_CLASS = "error_class"  # an ErrorClass, or null
    ERROR_MESSAGE = "error_message"
    FINISH_REASON = "finish_reason"  # as the server said
    INPUT_TOKENS = "input_tokens"  # from the workload, by its tokenizer
    USAGE_PROMPT_TOKENS = "usage_prompt_tokens"  # as the server reported; null when absent
    USAGE_COMPLETION_TOKENS = "usage_completion_tokens"
    CLIENT_OUTPUT_TOKENS = "client_output_tokens"  # counted by the client
    OUTPUT_TOKENS = "output_tokens"  # the figure metrics use
    OUTPUT_TOKENS_SOURCE = "output_tokens_source"  # a TokenSource
    OUTPUT_CHARS = "output_chars"
    OUTPUT_SHA256 = "output_sha256"
    NUM_CHUNKS = "num_chunks"
    IS_WARMUP = "is_warmup"
    OUTPUT_VALID = "output_valid"  # null: not checked; false: a verifier rejected the output
    RESPONSE_ID = "response_id"  # the `id` of the server's response (first event of a stream)
    ENGINE_REQUEST_ID = "engine_request_id"  # the answer's `x-request-id` header, when sent
    OUTPUT_EXACT_MATCH = "output_exact_match"  # null: no reference output to compare with
    OUTPUT_FIRST_DIVERGENCE = "output_first_divergence"  # first differing token index; null: none
    OUTPUT_AGREEMENT = "output_agreement"  # equal tokens by position / the longer output's length
    OUTPUT_FLAGS = "output_flags"  # comma-separated OutputFlag values, or null
    CHUNK_TOKENS_SOURCE = "chunk_tokens_source"  # a TokenSource: what counted each chunk's tokens
    USAGE_CACHED_TOKENS = "usage_cached_tokens"  # usage.prompt_tokens_details.cached_tokens
    SESSION_ID = "session_id"  # the conversation a multi-turn request belongs to; null: none
    TURN_INDEX = "turn_index"  # 0 for a session's first turn; null outside sessions
    # when the concurrency-cap slot it took was freed; null: no cap, or free from the start
    T_SLOT_FREED_NS = "t_slot_freed_ns"
    PRIORITY = "priority"  # the workload's priority, sent in the body; null: none
    DEADLINE_MS = "deadline_ms"  # the deadline sent (ms after the send); null: none
    TENANT = "tenant"  # the workload's tenant, sent as OpenAI's `user`; null: none
    # reasoning models (`harness.http.reasoning`): null where the stream had no such token
    T_FIRST_REASONING_TOKEN_NS = "t_first_reasoning_token_ns"
    T_LAST_REASONING_TOKEN_NS = "t_last_reasoning_token_ns"
    T_FIRST_ANSWER_TOKEN_NS = "t_first_answer_token_ns"
    OUTPUT_REASONING_TOKENS = "output_reasoning_tokens"  # tokens of the reasoning chunks; 0: none
    OUTPUT_ANSWER_TOKENS = "output_answer_tokens"  # tokens of the answer chunks
    USAGE_REASONING_TOKENS = "usage_reasoning_tokens"  # usage.completion_tokens_details
    # memory per request from the server's `usage.kv_memory` (engine_ref); null: not reported
    KV_PEAK_BYTES = "kv_peak_bytes"
    KV_MEAN_BYTES = "kv_mean_bytes"
    KV_AMORTISED_BYTES = "kv_amortised_bytes"
    KV_UNUSED_BYTES = "kv_unused_bytes"
    TEMP_PEAK_BYTES = "temp_peak_bytes"
    KV_EVICTED_TOKENS = "kv_evicted_tokens"
    NUM_TEXTS = "num_texts"  # inputs (embeddings) or documents (rerank) sent; null: generation
    NUM_TOOL_CALLS = "num_tool_calls"  # calls in the answer; null: no tools offered or used
    # a P/D cluster's KV handoff (`usage.kv_transfer`, `harness.load.kv_records`); null: none
    KV_PREFILL_MS = "kv_prefill_ms"
    KV_TRANSFER_BYTES = "kv_transfer_bytes"
    KV_TRANSFER_MS = "kv_transfer_ms"
    KV_INSTALL_MS = "kv_install_ms"
    KV_TRANSFER_OK = "kv_transfer_ok"
    KV_TRANSFER_RETRIED = "kv_transfer_retried"  # how a failed transfer was retried (`recompute`)
    SERVED_BY = "served_by"  # the worker that served it (a cluster's router says); null: unsaid


class ChunkColumn(StrEnum):
    """Columns of `chunks.parquet`."""

    REQUEST_ID = "request_id"
    T_NS = "t_ns"
    N_TOKENS = "n_tokens"  # tokens in the event (see chunk_tokens_source); 0: role/usage only
    N_CHARS = "n_chars"
    IS_REASONING = "is_reasoning"  # true: a reasoning chunk; false: answer; null: not marked


class ScheduleColumn(StrEnum):
    """Columns of `schedule.parquet`: every request the run meant to send, in plan order."""

    REQUEST_ID = "request_id"
    ARRIVAL_S = "arrival_s"  # offset from the start of the measured phase; null: closed loop
    IS_WARMUP = "is_warmup"


class ServerMetricColumn(StrEnum):
    """Columns of `server_metrics.parquet`."""

    T_NS = "t_ns"
    NAME = "name"  # the Prometheus sample name
    LABELS = "labels"  # JSON object, keys sorted
    VALUE = "value"


REQUEST_TIME_COLUMNS = (
    RequestColumn.T_SCHEDULED_NS,
    RequestColumn.T_SENT_NS,
    RequestColumn.T_FIRST_BYTE_NS,
    RequestColumn.T_FIRST_TOKEN_NS,
    RequestColumn.T_LAST_TOKEN_NS,
    RequestColumn.T_DONE_NS,
    RequestColumn.T_SLOT_FREED_NS,
)

_C = RequestColumn
_REQUEST_TYPES = {
    _C.REQUEST_ID: pa.string(),
    **dict.fromkeys(REQUEST_TIME_COLUMNS, pa.int64()),
    _C.STATUS: pa.string(),
    _C.HTTP_STATUS: pa.int32(),
    _C.ERROR_CLASS: pa.string(),
    _C.ERROR_MESSAGE: pa.string(),
    _C.FINISH_REASON: pa.string(),
    _C.INPUT_TOKENS: pa.int32(),
    _C.USAGE_PROMPT_TOKENS: pa.int32(),
    _C.USAGE_COMPLETION_TOKENS: pa.int32(),
    _C.CLIENT_OUTPUT_TOKENS: pa.int32(),
    _C.OUTPUT_TOKENS: pa.int32(),
    _C.OUTPUT_TOKENS_SOURCE: pa.string(),
    _C.OUTPUT_CHARS: pa.int32(),
    _C.OUTPUT_SHA256: pa.string(),
    _C.NUM_CHUNKS: pa.int32(),
    _C.IS_WARMUP: pa.bool_(),
    _C.OUTPUT_VALID: pa.bool_(),
    _C.RESPONSE_ID: pa.string(),
    _C.ENGINE_REQUEST_ID: pa.string(),
    _C.OUTPUT_EXACT_MATCH: pa.bool_(),
    _C.OUTPUT_FIRST_DIVERGENCE: pa.int32(),
    _C.OUTPUT_AGREEMENT: pa.float64(),
    _C.OUTPUT_FLAGS: pa.string(),
    _C.CHUNK_TOKENS_SOURCE: pa.string(),
    _C.USAGE_CACHED_TOKENS: pa.int32(),
    _C.SESSION_ID: pa.string(),
    _C.TURN_INDEX: pa.int32(),
    _C.PRIORITY: pa.int32(),
    _C.DEADLINE_MS: pa.int32(),
    _C.TENANT: pa.string(),
    _C.T_FIRST_REASONING_TOKEN_NS: pa.int64(),
    _C.T_LAST_REASONING_TOKEN_NS: pa.int64(),
    _C.T_FIRST_ANSWER_TOKEN_NS: pa.int64(),
    _C.OUTPUT_REASONING_TOKENS: pa.int32(),
    _C.OUTPUT_ANSWER_TOKENS: pa.int32(),
    _C.USAGE_REASONING_TOKENS: pa.int32(),
    _C.KV_PEAK_BYTES: pa.int64(),
    _C.KV_MEAN_BYTES: pa.int64(),
    _C.KV_AMORTISED_BYTES: pa.int64(),
    _C.KV_UNUSED_BYTES: pa.int64(),
    _C.TEMP_PEAK_BYTES: pa.int64(),
    _C.KV_EVICTED_TOKENS: pa.int32(),
    _C.NUM_TEXTS: pa.int32(),
    _C.NUM_TOOL_CALLS: pa.int32(),
    _C.KV_PREFILL_MS: pa.float64(),
    _C.KV_TRANSFER_BYTES: pa.int64(),
    _C.KV_TRANSFER_MS: pa.float64(),
    _C.KV_INSTALL_MS: pa.float64(),
    _C.KV_TRANSFER_OK: pa.bool_(),
    _C.KV_TRANSFER_RETRIED: pa.string(),
    _C.SERVED_BY: pa.string(),
}
REQUESTS_SCHEMA = pa.schema([(str(c), _REQUEST_TYPES[c]) for c in RequestColumn])

CHUNKS_SCHEMA = pa.schema(
    [
        (ChunkColumn.REQUEST_ID.value, pa.string()),
        (ChunkColumn.T_NS.value, pa.int64()),
        (ChunkColumn.N_TOKENS.value, pa.int32()),
        (ChunkColumn.N_CHARS.value, pa.int32()),
        (ChunkColumn.IS_REASONING.value, pa.bool_()),
    ]
)

SCHEDULE_SCHEMA = pa.schema(
    [
        (ScheduleColumn.REQUEST_ID.value, pa.string()),
        (ScheduleColumn.ARRIVAL_S.value, pa.float64()),
        (ScheduleColumn.IS_WARMUP.value, pa.bool_()),
    ]
)

SERVER_METRICS_SCHEMA = pa.schema(
    [
        (ServerMetricColumn.T_NS.value, pa.int64()),
        (ServerMetricColumn.NAME.value, pa.string()),
        (ServerMetricColumn.LABELS.value, pa.string()),
        (ServerMetricColumn.VALUE.value, pa.float64()),
    ]
)


@dataclass(slots=True)
class RequestRecord:
    """One row of `requests.parquet`, field for column (see `RequestColumn` for meanings).

    The enum-typed fields accept their members or their string values; anything else is a
    `RunRecordError` when the row is written, so a misspelt status never reaches disk.
    """

    request_id: str
    t_scheduled_ns: int | None = None
    t_sent_ns: int | None = None
    t_first_byte_ns: int | None = None
    t_first_token_ns: int | None = None
    t_last_token_ns: int | None = None
    t_done_ns: int | None = None
    status: RequestStatus = RequestStatus.UNKNOWN
    http_status: int | None = None
    error_class: ErrorClass | None = None
    error_message: str | None = None
    finish_reason: str | None = None
    input_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    client_output_tokens: int | None = None
    output_tokens: int | None = None
    output_tokens_source: TokenSource | None = None
    output_chars: int | None = None
    output_sha256: str | None = None
    num_chunks: int | None = None
    is_warmup: bool = False
    output_valid: bool | None = None
    response_id: str | None = None
    engine_request_id: str | None = None
    output_exact_match: bool | None = None
    output_first_divergence: int | None = None
    output_agreement: float | None = None
    output_flags: str | None = None
    chunk_tokens_source: TokenSource | None = None
    usage_cached_tokens: int | None = None
    session_id: str | None = None
    turn_index: int | None = None
    t_slot_freed_ns: int | None = None
    priority: int | None = None
    deadline_ms: int | None = None
    tenant: str | None = None
    t_first_reasoning_token_ns: int | None = None
    t_last_reasoning_token_ns: int | None = None
    t_first_answer_token_ns: int | None = None
    output_reasoning_tokens: int | None = None
    output_answer_tokens: int | None = None
    usage_reasoning_tokens: int | None = None
    kv_peak_bytes: int | None = None
    kv_mean_bytes: int | None = None
    kv_amortised_bytes: int | None = None
    kv_unused_bytes: int | None = None
    temp_peak_bytes: int | None = None
    kv_evicted_tokens: int | None = None
    num_texts: int | None = None
    num_tool_calls: int | None = None
    kv_prefill_ms: float | None = None
    kv_transfer_bytes: int | None = None
    kv_transfer_ms: float | None = None
    kv_install_ms: float | None = None
    kv_transfer_ok: bool | None = None
    kv_transfer_retried: str | None = None
    served_by: str | None = None

    def validated(self) -> tuple:
        """The row as a tuple in column order, with enum fields checked and stored as strings."""
        row = list(astuple(self))
        for index, kind, what in _ENUM_FIELDS:
            value = row[index]
            if value is None:
                if kind is RequestStatus:
                    raise RunRecordError(f"request {self.request_id!r} has no status.")
                continue
            try:
                row[index] = kind(value).value
            except ValueError:
                allowed = ", ".join(m.value for m in kind)
                raise RunRecordError(
                    f"request {self.request_id!r}: {what} must be one of {allowed}, got {value!r}."
                ) from None
        return tuple(row)


@dataclass(slots=True)
class ChunkRecord:
    """One row of `chunks.parquet`."""

    request_id: str
    t_ns: int
    n_tokens: int
    n_chars: int
    is_reasoning: bool | None = None


_NAMES = [f.name for f in fields(RequestRecord)]
if _NAMES != [c.value for c in RequestColumn] or [f.name for f in fields(ChunkRecord)] != [
    c.value for c in ChunkColumn
]:  # the record types and the column enums are one contract; keep them in step
    raise RunRecordError(
        "run-record columns and record fields differ; fix slo/runrecord/schema.py."
    )
_ENUM_FIELDS = (
    (_NAMES.index(RequestColumn.STATUS), RequestStatus, RequestColumn.STATUS.value),
    (_NAMES.index(RequestColumn.ERROR_CLASS), ErrorClass, RequestColumn.ERROR_CLASS.value),
    (
        _NAMES.index(RequestColumn.OUTPUT_TOKENS_SOURCE),
        TokenSource,
        RequestColumn.OUTPUT_TOKENS_SOURCE.value,
    ),
    (
        _NAMES.index(RequestColumn.CHUNK_TOKENS_SOURCE),
        TokenSource,
        RequestColumn.CHUNK_TOKENS_SOURCE.value,
    ),
)


def requests_table(records: list[RequestRecord]) -> pa.Table:
    """A `REQUESTS_SCHEMA` table from records (validated; see `RequestRecord.validated`)."""
    if not records:
        return REQUESTS_SCHEMA.empty_table()
    columns = list(zip(*(r.validated() for r in records), strict=True))
    return pa.Table.from_arrays(
        [pa.array(col, type=f.type) for col, f in zip(columns, REQUESTS_SCHEMA, strict=True)],
        schema=REQUESTS_SCHEMA,
    )


def columns_table(rows: list[tuple], schema: pa.Schema) -> pa.Table:
    """A table of `schema` from row tuples in column order (chunks, server metrics). Rows
    shorter than the schema leave its trailing columns null (a chunk row without its
    `reasoning` marker)."""
    if not rows:
        return schema.empty_table()
    columns = list(zip(*rows, strict=True))
    columns += [(None,) * len(rows)] * (len(schema) - len(columns))
    return pa.Table.from_arrays(
        [pa.array(col, type=f.type) for col, f in zip(columns, schema, strict=True)],
        schema=schema,
    )
