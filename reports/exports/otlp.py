"""A run directory as OpenTelemetry traces: an OTLP/JSON `ExportTraceServiceRequest`.

Why: Jaeger, Tempo or any OTLP collector can then show the client's view of every request
beside the server's own traces (vLLM and SGLang export OTLP spans), on one time axis.

Shape. One trace per run; its id is derived from the run id (sha256), so exporting the same
run twice gives the same trace and span ids. One root span for the run (kind INTERNAL, from the
measured phase's start to the last request's end) and one child span per request that was sent
(kind CLIENT, from `t_sent_ns` to `t_done_ns`), named `{gen_ai.operation.name}
{gen_ai.request.model}` as the GenAI conventions ask. A request that was never sent
(`not_sent`) has no span: it never reached the target, so there is no operation to show; the
root span counts them (`llm_bench.requests.not_sent`). A sent request without a terminal time
(a run whose writer died) ends at its last recorded time and carries `llm_bench.unfinished`.
Each request span has one event per phase it reached (`llm_bench.scheduled`, `.sent`,
`.first_byte`, `.first_token`, `.last_token`, `.done`) and, when a token arrived, a child span
`time_to_first_token` (sent to first token). `llm_bench.scheduled` can precede the span's start
by the time the request waited for its send (dispatch lag, a concurrency slot); that wait is
not a child span, because a child that starts before its parent confuses trace viewers.

Attributes follow the OpenTelemetry GenAI semantic conventions (registry of 2025-2026,
`semantic-conventions-genai`): `gen_ai.operation.name` (`chat` or `text_completion`, from the
recorded endpoint), `gen_ai.provider.name` (the engine the manifest names, when it names one),
`gen_ai.request.model`, `gen_ai.request.stream`, `gen_ai.usage.input_tokens` (the server's
`usage.prompt_tokens`, else the workload's count), `gen_ai.usage.output_tokens` (the figure the
metrics use), `gen_ai.usage.cache_read.input_tokens`, `gen_ai.response.finish_reasons`,
`gen_ai.response.id`, `gen_ai.response.time_to_first_chunk` (s, send to the first stream event),
`gen_ai.conversation.id` (the session), `server.address` / `server.port` (from the target URL),
`http.response.status_code` and, for every status but `ok`, `error.type` (the error class, or
the status where there is none, as for `cancelled`) with span status ERROR and the recorded
message. `gen_ai.request.max_tokens` is left out: the run directory does not keep each
request's limit. The harness's own facts are under `llm_bench.*` (`request_id`, `status`,
`output_tokens_source`, `turn_index` and the request class: `priority`, `deadline_ms`,
`tenant`).

The OTLP/JSON encoding (opentelemetry-proto `docs/specification.md`): lowerCamelCase keys,
64-bit integers and the `*UnixNano` times as decimal strings, enums as integers, and the trace
and span ids as lowercase hex (not base64 as protobuf's own JSON mapping has it).

Times: the table times are nanoseconds from the manifest's `t0_ns`, a `perf_counter_ns()`
reading with no wall-clock meaning; the manifest's only wall-clock start is `started_at`, which
the harness writes with one-second resolution when it plans the run, before the warm-up and
the start lead. A time here is `started_at + offset`: every span and event is placed exactly
relative to every other (the offsets are exact ns), but the whole run sits early by the
truncated fraction of a second plus the planning-to-start time (warm-up included), so aligning
it with a server's spans can need that shift. A manifest without `started_at`, or one without
a UTC offset, is refused rather than guessed.

One builder for two paths: `span_context` (from the manifest), `request_spans` (from one
requests-table row and its first stream event) and `root_span` (over a `RunTally`) make
both this export and the live push of `bench run --otlp` (`otlp_live`), so a collector fed
live receives exactly the spans this export writes for the same run directory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from reports.errors import ReportError
from slo.runrecord import (
    REQUEST_TIME_COLUMNS,
    ChunkColumn,
    Endpoint,
    RequestColumn,
    RequestStatus,
    RunManifest,
    RunRecordError,
    open_run,
)

SCOPE_NAME = "llm_bench.reports.exports.otlp"
SERVICE_NAME = "llm-bench"
SPAN_KIND_INTERNAL = 1
SPAN_KIND_CLIENT = 3
STATUS_CODE_ERROR = 2
EVENT_PREFIX = "llm_bench."
# The phases a request can reach, in order; each event is named after its column
# (`t_first_token_ns` -> `llm_bench.first_token`).
PHASES = tuple(c for c in REQUEST_TIME_COLUMNS if c is not RequestColumn.T_SLOT_FREED_NS)
# Request-class columns, exported as `llm_bench.<column>` when present.
CLASS_COLUMNS = (RequestColumn.PRIORITY, RequestColumn.DEADLINE_MS, RequestColumn.TENANT)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US = datetime.resolution  # datetime's own resolution
_DEFAULT_PORTS = {"http": 80, "https": 443}


def any_value(value) -> dict:
    """A Python value as an OTLP `AnyValue` (JSON mapping): int64 as a decimal string."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list | tuple):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def attributes(pairs: dict) -> list[dict]:
    """OTLP `KeyValue`s for `pairs`, leaving out the None values."""
    return [{"key": k, "value": any_value(v)} for k, v in pairs.items() if v is not None]


def trace_id(run_id: str) -> str:
    """The run's 32-hex trace id: the first 16 bytes of sha256 over the run id."""
    return _hex_id(f"llm-bench trace\0{run_id}", 16)


def span_id(run_id: str, *parts: str) -> str:
    """A 16-hex span id, unique within the run for each distinct `parts`."""
    return _hex_id("\0".join(("llm-bench span", run_id, *parts)), 8)


def _hex_id(text: str, n_bytes: int) -> str:
    digest = hashlib.sha256(text.encode()).digest()[:n_bytes]
    if not any(digest):  # an all-zero id is invalid in OTLP
        digest = digest[:-1] + b"\x01"
    return digest.hex()


def t0_unix_ns(manifest: RunManifest | None, run_dir: Path) -> int:
    """The wall-clock time (ns since the Unix epoch) that table offsets are added to: the
    manifest's `started_at` (see the module docstring for how exact it is)."""
    text = manifest.started_at if manifest is not None else None
    if not text:
        raise ReportError(
            f"{run_dir} records no wall-clock start (manifest.json `started_at`), so its "
            "requests cannot be placed in time; export a run written by `bench run`."
        )
    started = None
    for parse in (lambda t: datetime.strptime(t, "%Y-%m-%dT%H:%M:%S%z"), datetime.fromisoformat):
        try:
            started = parse(text)
            break
        except ValueError:
            continue
    if started is None or started.tzinfo is None:
        raise ReportError(
            f"{run_dir}'s manifest.json `started_at` ({text!r}) is not a time with a UTC "
            "offset, so its requests cannot be placed in time."
        )
    return (started - _EPOCH) // _ONE_US * 1000


def _phase_name(column: RequestColumn) -> str:
    return column.value.removeprefix("t_").removesuffix("_ns")


def _operation(manifest: RunManifest) -> str:
    recorded = str((manifest.target or {}).get("endpoint") or "")
    recorded = recorded or str((manifest.workload or {}).get("endpoint") or "")
    is_chat = Endpoint.CHAT.path in recorded or recorded == Endpoint.CHAT.value
    return "chat" if is_chat else "text_completion"


def _server(manifest: RunManifest) -> tuple[str | None, int | None]:
    url = (manifest.target or {}).get("url") or (manifest.config or {}).get("url")
    if not url:
        return None, None
    try:
        parts = urlsplit(str(url))
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None, None
    if not parts.hostname:
        return None, None
    return parts.hostname, port


def _first_chunk_ns(tables) -> dict[str, int]:
    """Each request's first stream event (ns from t0), from the chunks table."""
    chunks = tables.chunks
    if chunks.num_rows == 0:
        return {}
    first = chunks.group_by(ChunkColumn.REQUEST_ID.value).aggregate(
        [(ChunkColumn.T_NS.value, "min")]
    )
    ids = first[ChunkColumn.REQUEST_ID.value].to_pylist()
    times = first[f"{ChunkColumn.T_NS.value}_min"].to_pylist()
    return dict(zip(ids, times, strict=True))


@dataclass(frozen=True)
class SpanContext:
    """What every span of one run shares, read from its manifest once: the ids, the
    wall-clock anchor (`t0_unix_ns`, ns since the Unix epoch) and the attributes common to
    the run and each request. The export and the live push (`otlp_live`) build their spans
    from the same context, so both give the same spans for the same run."""

    run_id: str
    t0_unix_ns: int
    trace_id: str
    root_span_id: str
    common: dict
    harness_version: str | None


def span_context(manifest: RunManifest, run_dir: Path | str) -> SpanContext:
    """The run's `SpanContext`; ReportError for a manifest without a usable `started_at`."""
    run_dir = Path(run_dir)
    run_id = manifest.run_id or run_dir.name
    target = manifest.target or {}
    model = target.get("model") or (manifest.config or {}).get("model")
    address, port = _server(manifest)
    stream = (manifest.config or {}).get("stream")
    common = {
        "gen_ai.operation.name": _operation(manifest),
        "gen_ai.provider.name": target.get("engine"),
        "gen_ai.request.model": model,
        "gen_ai.request.stream": stream if isinstance(stream, bool) else None,
        "server.address": address,
        "server.port": port,
    }
    return SpanContext(
        run_id=run_id,
        t0_unix_ns=t0_unix_ns(manifest, run_dir),
        trace_id=trace_id(run_id),
        root_span_id=span_id(run_id, "run"),
        common=common,
        harness_version=manifest.harness_version,
    )


def request_extent(row) -> tuple[int, int] | None:
    """A request span's (start, end), ns from t0: its send to its terminal time (its last
    recorded time when it has none); None for a request never sent. `row` maps the time
    columns to their values (a requests-table row)."""
    sent = row.get(RequestColumn.T_SENT_NS)
    if sent is None:
        return None
    done = row.get(RequestColumn.T_DONE_NS)
    if done is not None:
        return sent, done
    return sent, max(t for col in PHASES if (t := row.get(col)) is not None)


@dataclass
class RunTally:
    """What the root span says of the requests: how many rows, how many never sent, and the
    span of time their spans cover (ns from t0; the root starts at t0 at the latest)."""

    total: int = 0
    not_sent: int = 0
    first_start: int = 0
    last_end: int = 0

    def add(self, row) -> None:
        """Count one requests-table row (a mapping of its columns)."""
        self.total += 1
        extent = request_extent(row)
        if extent is None:
            self.not_sent += 1
            return
        self.first_start = min(self.first_start, extent[0])
        self.last_end = max(self.last_end, extent[1])


def root_span(ctx: SpanContext, tally: RunTally, *, complete: bool) -> dict:
    """The run's root span (kind INTERNAL) over the requests `tally` counted."""
    t0 = ctx.t0_unix_ns
    return {
        "traceId": ctx.trace_id,
        "spanId": ctx.root_span_id,
        "name": f"bench run {ctx.run_id}",
        "kind": SPAN_KIND_INTERNAL,
        "startTimeUnixNano": str(t0 + tally.first_start),
        "endTimeUnixNano": str(t0 + tally.last_end),
        "attributes": attributes(
            {
                "llm_bench.run_id": ctx.run_id,
                "llm_bench.run.complete": bool(complete),
                "llm_bench.requests.total": tally.total,
                "llm_bench.requests.not_sent": tally.not_sent,
                "llm_bench.time_anchor": "manifest.started_at",
                **ctx.common,
            }
        ),
        "status": {},
    }


def traces_document(ctx: SpanContext, spans: list[dict]) -> dict:
    """An `ExportTraceServiceRequest` (OTLP/JSON) carrying `spans` of the run."""
    resource = attributes({"service.name": SERVICE_NAME,
                           "service.version": ctx.harness_version})  # fmt: skip
    scope = {"name": SCOPE_NAME, "version": ctx.harness_version or ""}
    return {"resourceSpans": [{
        "resource": {"attributes": resource},
        "scopeSpans": [{"scope": scope, "spans": spans}],
    }]}  # fmt: skip


def otlp_traces(run_dir: Path | str) -> dict:
    """The OTLP/JSON `ExportTraceServiceRequest` dict for `run_dir` (see the module
    docstring). Raises ReportError for an unreadable run directory or one without a
    wall-clock start."""
    run_dir = Path(run_dir)
    try:
        tables = open_run(run_dir)
    except RunRecordError as exc:
        raise ReportError(str(exc)) from exc
    ctx = span_context(tables.manifest, run_dir)
    first_chunks = _first_chunk_ns(tables)
    spans, tally = [], RunTally()
    for row in tables.requests.to_pylist():
        tally.add(row)
        rid = str(row[RequestColumn.REQUEST_ID])
        spans.extend(request_spans(row, ctx, first_chunks.get(rid)))
    root = root_span(ctx, tally, complete=bool(tables.manifest.complete))
    return traces_document(ctx, [root, *spans])


def request_spans(row: dict, ctx: SpanContext, first_chunk_ns: int | None) -> list[dict]:
    """A request's span and its time-to-first-token child, from its requests-table row and
    its first stream event (`first_chunk_ns`, ns from t0; None: none arrived); none when it
    was never sent."""
    extent = request_extent(row)
    if extent is None:
        return []
    sent, end = extent
    t0, common = ctx.t0_unix_ns, ctx.common
    rid = str(row[RequestColumn.REQUEST_ID])
    phases = [(_phase_name(col), row.get(col)) for col in PHASES if row.get(col) is not None]
    done = row.get(RequestColumn.T_DONE_NS)
    status = row.get(RequestColumn.STATUS)
    failed = status is not None and status != RequestStatus.OK
    input_tokens = row.get(RequestColumn.USAGE_PROMPT_TOKENS)
    if input_tokens is None:  # the server sent no usage: the workload's own count
        input_tokens = row.get(RequestColumn.INPUT_TOKENS)
    finish = row.get(RequestColumn.FINISH_REASON)
    to_first_chunk_s = (first_chunk_ns - sent) / 1e9 if first_chunk_ns is not None else None
    own = {
        **common,
        "gen_ai.usage.input_tokens": input_tokens,
        "gen_ai.usage.output_tokens": row.get(RequestColumn.OUTPUT_TOKENS),
        "gen_ai.usage.cache_read.input_tokens": row.get(RequestColumn.USAGE_CACHED_TOKENS),
        "gen_ai.response.finish_reasons": [finish] if finish is not None else None,
        "gen_ai.response.id": row.get(RequestColumn.RESPONSE_ID),
        "gen_ai.response.time_to_first_chunk": to_first_chunk_s,
        "gen_ai.conversation.id": row.get(RequestColumn.SESSION_ID),
        "http.response.status_code": row.get(RequestColumn.HTTP_STATUS),
        "error.type": (row.get(RequestColumn.ERROR_CLASS) or status) if failed else None,
        "llm_bench.request_id": rid,
        "llm_bench.status": status,
        "llm_bench.output_tokens_source": row.get(RequestColumn.OUTPUT_TOKENS_SOURCE),
        "llm_bench.turn_index": row.get(RequestColumn.TURN_INDEX),
        **{f"llm_bench.{c.value}": row.get(c) for c in CLASS_COLUMNS},
        "llm_bench.unfinished": True if done is None else None,
    }  # fmt: skip
    name = f"{common['gen_ai.operation.name']} {common['gen_ai.request.model'] or ''}".strip()
    own_id = span_id(ctx.run_id, "request", rid)
    span = {
        "traceId": ctx.trace_id,
        "spanId": own_id,
        "parentSpanId": ctx.root_span_id,
        "name": name,
        "kind": SPAN_KIND_CLIENT,
        "startTimeUnixNano": str(t0 + sent),
        "endTimeUnixNano": str(t0 + end),
        "attributes": attributes(own),
        "events": [{"timeUnixNano": str(t0 + t), "name": EVENT_PREFIX + phase}
                   for phase, t in phases],  # fmt: skip
        "status": {"code": STATUS_CODE_ERROR,
                   "message": row.get(RequestColumn.ERROR_MESSAGE) or str(status)}
        if failed else {},
    }  # fmt: skip
    first_token = row.get(RequestColumn.T_FIRST_TOKEN_NS)
    if first_token is None:
        return [span]
    ttft = {
        "traceId": ctx.trace_id,
        "spanId": span_id(ctx.run_id, "ttft", rid),
        "parentSpanId": own_id,
        "name": "time_to_first_token",
        "kind": SPAN_KIND_INTERNAL,
        "startTimeUnixNano": str(t0 + sent),
        "endTimeUnixNano": str(t0 + first_token),
        "attributes": attributes({"llm_bench.request_id": rid}),
        "status": {},
    }
    return [span, ttft]
