"""Turn a request's raw timeline into its `requests.parquet` row and `chunks.parquet` rows."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from harness.http.client import RawResult
from harness.http.events import parse_answer_body, parse_answer_stream
from harness.http.sse import ParsedStream
from harness.load.dense_records import dense_record
from harness.load.kv_records import set_kv_transfer
from harness.load.output_checks import CheckResult, OutputChecks
from harness.load.reasoning_records import set_reasoning
from harness.load.tool_checks import tool_call_count
from slo.runrecord import (
    Endpoint,
    ErrorClass,
    RequestColumn,
    RequestRecord,
    RequestStatus,
    TokenSource,
)

TokenCounter = Callable[[str], int]


# Distinct chunk texts whose token counts are remembered: a streamed chunk is mostly one
# token, so its text is one of the vocabulary's strings and the counts repeat (a run of
# millions of chunks would otherwise encode each one: about 11 us apiece here).
CHUNK_COUNT_CACHE = 1 << 16


@dataclass(frozen=True, slots=True)
class RecordContext:
    """What turning raw results into rows needs besides the results themselves.

    `count_tokens` counts a text's tokens with the run's tokenizer (a pure function of the
    text); `count_chunk_tokens` is the same count remembered for the most recent distinct
    chunk texts, made from it unless given."""

    t0_ns: int
    is_chat: bool
    count_tokens: TokenCounter | None = None
    checks: OutputChecks | None = None
    count_chunk_tokens: TokenCounter | None = None
    endpoint: Endpoint = Endpoint.COMPLETIONS
    batch_sizes: dict[str, int] | None = None  # request id -> texts sent (embeddings, rerank)

    def __post_init__(self) -> None:
        if self.count_chunk_tokens is None and self.count_tokens is not None:
            cached = functools.lru_cache(maxsize=CHUNK_COUNT_CACHE)(self.count_tokens)
            object.__setattr__(self, "count_chunk_tokens", cached)


def _rel(t_ns: int | None, t0_ns: int) -> int | None:
    return None if t_ns is None else t_ns - t0_ns


KV_MEMORY_FIELDS = (
    RequestColumn.KV_PEAK_BYTES,
    RequestColumn.KV_MEAN_BYTES,
    RequestColumn.KV_AMORTISED_BYTES,
    RequestColumn.KV_UNUSED_BYTES,
    RequestColumn.TEMP_PEAK_BYTES,
    RequestColumn.KV_EVICTED_TOKENS,
)


def _set_kv_memory(record: RequestRecord, kv_memory: object) -> None:
    """The reference engine's memory per request (`usage.kv_memory`), field by field; a field
    that is missing or not a non-negative integer stays null."""
    if not isinstance(kv_memory, dict):
        return
    for column in KV_MEMORY_FIELDS:
        value = kv_memory.get(str(column))
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62:
            setattr(record, str(column), value)


def _slot_freed(raw: RawResult, t0_ns: int) -> int | None:
    """When the concurrency-cap slot the request took was freed, relative to t0 (None: no
    cap, or a slot free from the start). The load generator hands it as an offset from the
    scheduled time (see `harness.load.loadgen.DispatchedResult`); other results have none."""
    offset_ns = getattr(raw, "slot_freed_offset_ns", None)
    if offset_ns is None or raw.t_scheduled_ns is None:
        return None
    return raw.t_scheduled_ns + offset_ns - t0_ns


def _retokenise_chunks(parsed: ParsedStream, count_tokens: TokenCounter) -> None:
    """Count each text event's tokens with the run's tokenizer (the server said neither its
    usage so far nor token ids): each event's text on its own, at least one token. Each
    distinct text is counted once."""
    counts = np.array([max(1, count_tokens(text)) for text in parsed.texts] + [0], np.int64)
    parsed.n_tokens = counts[parsed.text_id]  # text_id -1 (no text) reads the trailing 0
    parsed.chunk_tokens_source = TokenSource.TOKENIZER


@dataclass(slots=True)
class ChunkRows:
    """One request's `chunks.parquet` rows as columns; `t_ns` relative to the run's t0."""

    request_id: str
    t_ns: np.ndarray
    n_tokens: np.ndarray
    n_chars: np.ndarray
    reasoning: np.ndarray | None = None  # bool per chunk (`reasoning_records`); None: unmarked

    def __len__(self) -> int:
        return len(self.t_ns)

    def __iter__(self):
        return iter(self.rows())

    def rows(self) -> list[tuple[str, int, int, int]]:
        """`(request_id, t_ns, n_tokens, n_chars)` per chunk (the marker is a column only)."""
        rid = self.request_id
        return [
            (rid, t, n, c)
            for t, n, c in zip(
                self.t_ns.tolist(), self.n_tokens.tolist(), self.n_chars.tolist(), strict=True
            )
        ]


_NO_CHUNKS = np.zeros(0, np.int64)


def _no_chunks(raw: RawResult) -> ChunkRows:
    return ChunkRows(raw.request_id, _NO_CHUNKS, _NO_CHUNKS, _NO_CHUNKS)


def to_rows(
    raw: RawResult,
    input_tokens: int | None,
    ctx: RecordContext,
    session: tuple[str, int] | None = None,
    request_class: tuple[int | None, int | None, str | None] | None = None,
) -> tuple[RequestRecord, ChunkRows]:
    """Build the request record and its chunk rows; `session` is the request's (session id,
    turn index) in a multi-turn workload, `request_class` its (priority, deadline_ms,
    tenant) when the workload gave any."""
    if not ctx.endpoint.generates:
        slot_freed = _slot_freed(raw, ctx.t0_ns)
        record = dense_record(raw, input_tokens, ctx, slot_freed, session, request_class)
        return record, _no_chunks(raw)
    parsed: ParsedStream | None = None
    status, error_class, error_message = raw.status, raw.error_class, raw.error_message
    if status is None:
        if raw.body is not None:
            parsed = parse_answer_body(raw.body, ctx.endpoint, chat=ctx.is_chat)
            parsed.set_chunks([raw.t_done_ns], [1 if parsed.text else 0], [len(parsed.text)])
        else:
            parsed = parse_answer_stream(raw.reads, ctx.endpoint, chat=ctx.is_chat)
        if parsed.error_class is None:
            status = RequestStatus.OK
        else:
            # A stream cut before its terminal event leaves the outcome unknown.
            cut = parsed.error_class is ErrorClass.INCOMPLETE_STREAM
            status = RequestStatus.UNKNOWN if cut else RequestStatus.ERROR
            error_class, error_message = parsed.error_class, parsed.error_message
    elif raw.reads:  # failed mid-stream: keep what arrived
        parsed = parse_answer_stream(raw.reads, ctx.endpoint, chat=ctx.is_chat)

    # Only a stream with text has a chunk source; CHUNK_COUNT: the server counted no chunk.
    counted_by_events = parsed is not None and parsed.chunk_tokens_source is TokenSource.CHUNK_COUNT
    if counted_by_events and ctx.count_chunk_tokens is not None:
        _retokenise_chunks(parsed, ctx.count_chunk_tokens)
    # A non-streamed response arrives whole: no token was seen before the last byte, so the
    # first and last token times are unknown (TTFT, TPOT and ITL undefined), not t_done.
    streamed = raw.body is None
    token_times = parsed.t_ns[parsed.n_tokens > 0] if parsed and streamed else _NO_CHUNKS
    text = parsed.text if parsed else ""
    usage = (parsed.usage if parsed else None) or {}
    client_tokens = int(parsed.n_tokens.sum()) if parsed else 0
    usage_completion = usage.get("completion_tokens")
    if status is RequestStatus.NOT_SENT:
        output_tokens, source = None, None
    elif usage_completion is not None:
        output_tokens, source = int(usage_completion), TokenSource.USAGE
    elif parsed is not None and parsed.chunk_tokens_source is TokenSource.TOKEN_IDS:
        output_tokens, source = client_tokens, TokenSource.TOKEN_IDS
    elif ctx.count_tokens is not None and text:
        output_tokens, source = ctx.count_tokens(text), TokenSource.TOKENIZER
    else:
        output_tokens, source = client_tokens, TokenSource.CHUNK_COUNT
    if raw.body is not None and parsed is not None and len(parsed.t_ns):
        # A non-streamed response is one chunk holding every token.
        parsed.n_tokens = np.array([output_tokens], np.int64)
        client_tokens = output_tokens

    checked = CheckResult()
    if ctx.checks is not None and status is RequestStatus.OK:
        checked = ctx.checks.check(
            raw.request_id,
            text,
            output_tokens=output_tokens,
            usage_completion_tokens=usage_completion,
            token_chunks=len(token_times),
            client_tokens=client_tokens,
            streamed=raw.body is None,
            tool_calls=parsed.tool_calls if parsed else None,
        )
    t0 = ctx.t0_ns
    chunk_source = parsed.chunk_tokens_source if parsed and len(token_times) else None
    record = RequestRecord(
        request_id=raw.request_id,
        t_scheduled_ns=_rel(raw.t_scheduled_ns, t0),
        t_sent_ns=_rel(raw.t_sent_ns, t0),
        t_first_byte_ns=_rel(raw.t_first_byte_ns, t0),
        t_first_token_ns=int(token_times[0]) - t0 if len(token_times) else None,
        t_last_token_ns=int(token_times[-1]) - t0 if len(token_times) else None,
        t_done_ns=_rel(raw.t_done_ns, t0),
        status=status,
        http_status=raw.http_status,
        error_class=error_class,
        error_message=error_message,
        finish_reason=parsed.finish_reason if parsed else None,
        input_tokens=input_tokens,
        usage_prompt_tokens=usage.get("prompt_tokens"),
        usage_completion_tokens=usage_completion,
        client_output_tokens=client_tokens,
        output_tokens=output_tokens,
        output_tokens_source=source,
        output_chars=len(text),
        output_sha256=hashlib.sha256(text.encode()).hexdigest() if parsed else None,
        num_chunks=len(parsed.t_ns) if parsed else 0,
        is_warmup=raw.is_warmup,
        output_valid=checked.valid,
        response_id=parsed.response_id if parsed else None,
        engine_request_id=raw.engine_request_id,
        output_exact_match=checked.exact,
        output_first_divergence=checked.first_divergence,
        output_agreement=checked.agreement,
        output_flags=checked.flags,
        chunk_tokens_source=chunk_source,
        usage_cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        session_id=session[0] if session else None,
        turn_index=session[1] if session else None,
        t_slot_freed_ns=_slot_freed(raw, t0),
    )
    if request_class is not None:
        record.priority, record.deadline_ms, record.tenant = request_class
    _set_kv_memory(record, usage.get("kv_memory"))
    set_kv_transfer(record, usage, raw.worker)
    offered = ctx.checks is not None and ctx.checks.offers_tools(raw.request_id)
    calls = parsed.tool_calls if parsed else None
    record.num_tool_calls = tool_call_count(calls, offered, status is RequestStatus.OK)
    marks = set_reasoning(
        record, parsed, streamed=streamed, t0_ns=t0, usage=usage, count_tokens=ctx.count_tokens
    )
    if parsed is None:
        return record, ChunkRows(raw.request_id, _NO_CHUNKS, _NO_CHUNKS, _NO_CHUNKS)
    chunks = ChunkRows(raw.request_id, parsed.t_ns - t0, parsed.n_tokens, parsed.n_chars, marks)
    return record, chunks
