"""`bench run --otlp URL`: push a run's spans to an OTLP/HTTP collector while the run runs.

Why: Jaeger or Tempo then show the requests of a run that is still going, beside the
server's own traces, instead of after a `bench export --format otlp-json` at the end.

What is pushed is what the export writes: each request's spans are built by
`reports.exports.otlp.request_spans` from the same requests-table row (the recorder's
`RequestRecord`s go through the writer's own `requests_table`) and the same first stream
event, in the same `SpanContext`, and the root span by `root_span` over the same tally; so
the spans a collector receives equal `bench export RUN --format otlp-json` of the run
directory. Spans travel as OTLP/JSON (`POST {URL}/v1/traces`, `Content-Type:
application/json`; opentelemetry-proto `docs/specification.md`, "OTLP/HTTP").

Off the load's path. The recorder hands each flush's records to `add`, which only counts
them for the root span and queues them (a deque under a lock): nothing is parsed, encoded
or sent on the load's event loop. A background thread builds the spans and posts them in
batches: when `batch_spans` are waiting, else every `interval_s`. A collector that is slow,
down or refuses never slows or fails the run:
- the queue holds at most `max_queue_spans` spans; a request whose spans do not fit is
  dropped (its spans counted in `spans_dropped`), so memory is bounded by the bound, not
  by the collector's speed;
- a batch that fails with a connection error, a timeout or HTTP 429/502/503/504 (the
  statuses OTLP/HTTP calls retryable) is tried again up to `retries` times, after 0.1 s,
  0.2 s, ...; any other answer, or the last failure, fails the batch (`batches_failed`,
  `last_error`; its spans count as dropped);
- at the run's end `close` queues the root span and waits at most `drain_s` for the
  queue to empty; what is still queued or in flight then counts as dropped. So the push
  adds at most `drain_s` (default 5 s) to a run, whatever the collector does.
`spans_sent + spans_dropped` is every span the run produced. Spans a collector reports as
rejected (`partialSuccess.rejectedSpans`) count as dropped too.

Headers (`--otlp-header 'Name: value'`, for a collector that wants a token) and any
credentials in the URL are sent and never recorded: the manifest's `otlp.endpoint` is the
URL without its user, password and query.
"""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from reports.errors import ReportError
from reports.exports.otlp import (
    PHASES,
    RunTally,
    request_spans,
    root_span,
    span_context,
    traces_document,
)
from slo.runrecord import RequestColumn, RequestRecord, RunManifest
from slo.runrecord.schema import requests_table

TRACES_PATH = "/v1/traces"
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
DEFAULT_MAX_QUEUE_SPANS = 8192
DEFAULT_BATCH_SPANS = 512
DEFAULT_INTERVAL_S = 1.0
DEFAULT_RETRIES = 2
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_DRAIN_S = 5.0
FIRST_BACKOFF_S = 0.1
ERROR_TEXT_CHARS = 200
_TIME_COLUMNS = (RequestColumn.T_SENT_NS, *PHASES)


@dataclass(frozen=True)
class OtlpEndpoint:
    """Where spans go: `traces_url` (credentials and query kept, for sending), `headers`
    (sent with every POST) and `shown` (the URL without credentials or query: recorded)."""

    traces_url: str
    headers: tuple[tuple[str, str], ...]
    shown: str


def parse_endpoint(url: str, headers: tuple[str, ...] = ()) -> OtlpEndpoint:
    """`--otlp URL` and its `--otlp-header 'Name: value'`s; ReportError (one sentence) for
    a URL that is not http(s) with a host, or a header without a name and a colon. The
    traces path `/v1/traces` is appended unless the URL already ends with it."""
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError as exc:
        raise ReportError(
            f"--otlp {url!r} is not a URL ({exc}); give e.g. http://127.0.0.1:4318."
        ) from exc
    if parts.scheme not in ("http", "https") or not host:
        raise ReportError(
            f"--otlp {url!r} is not an http(s) URL with a host; give the collector's OTLP/HTTP "
            "address, e.g. http://127.0.0.1:4318."
        )
    path = parts.path.rstrip("/")
    if not path.endswith(TRACES_PATH):
        path += TRACES_PATH
    netloc = parts.netloc.rsplit("@", 1)[-1]
    sent_headers = []
    if parts.username is not None:  # credentials in the URL: basic auth, never recorded
        secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        sent_headers.append(
            ("Authorization", "Basic " + base64.b64encode(secret.encode()).decode())
        )
    for header in headers:
        name, colon, value = header.partition(":")
        if not colon or not name.strip() or any(c.isspace() for c in name.strip()):
            raise ReportError(
                f"--otlp-header {header.split(':')[0].strip()[:40]!r}... is not 'Name: value'; "
                "give a header name, a colon and its value."
            )
        sent_headers.append((name.strip(), value.strip()))
    return OtlpEndpoint(
        traces_url=urlunsplit((parts.scheme, netloc, path, parts.query, "")),
        headers=tuple(sent_headers),
        shown=urlunsplit((parts.scheme, netloc, path, "", "")),
    )


class PushError(Exception):
    """One failed POST: `retryable` says whether trying again can help."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def post_json(endpoint: OtlpEndpoint, body: bytes, timeout_s: float) -> int:
    """POST one OTLP/JSON body; the number of spans the collector rejected (its
    `partialSuccess`), or PushError."""
    headers = {"Content-Type": "application/json", **dict(endpoint.headers)}
    request = urllib.request.Request(endpoint.traces_url, body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # noqa: S310 - http(s) only
            text = answer.read()
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the answer's connection
        raise PushError(
            f"HTTP {exc.code} from {endpoint.shown}", retryable=exc.code in RETRYABLE_STATUS
        ) from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise PushError(f"{endpoint.shown}: {reason}"[:ERROR_TEXT_CHARS], retryable=True) from exc
    try:
        partial = json.loads(text or b"{}").get("partialSuccess") or {}
        return int(partial.get("rejectedSpans") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0  # an answer that is not the JSON response: the spans were taken


def spans_of(record: RequestRecord) -> int:
    """How many spans `request_spans` gives a record: none unsent, two with a first token."""
    if record.t_sent_ns is None:
        return 0
    return 1 + (record.t_first_token_ns is not None)


class OtlpPush:
    """One run's live push (a `harness.run.extensions.RecordSink`): `add` each flush's
    records, `close` once at the end, then `manifest_changes` and `warning`. See the module
    docstring for the bounds; `post` is the one POST (a test may replace it)."""

    def __init__(
        self,
        endpoint: OtlpEndpoint,
        manifest: RunManifest,
        run_dir: Path,
        *,
        max_queue_spans: int = DEFAULT_MAX_QUEUE_SPANS,
        batch_spans: int = DEFAULT_BATCH_SPANS,
        interval_s: float = DEFAULT_INTERVAL_S,
        retries: int = DEFAULT_RETRIES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        drain_s: float = DEFAULT_DRAIN_S,
        post: Callable[[OtlpEndpoint, bytes, float], int] = post_json,
    ) -> None:
        self.endpoint, self.context = endpoint, span_context(manifest, run_dir)
        self.max_queue_spans, self.batch_spans = max_queue_spans, batch_spans
        self.interval_s, self.retries, self.timeout_s = interval_s, retries, timeout_s
        self.drain_s, self.post = drain_s, post
        self.tally = RunTally()
        self.spans_sent = self.spans_dropped = self.batches_failed = 0
        self.last_error: str | None = None
        self.max_queued_spans = 0  # the most spans ever waiting (at most max_queue_spans + 1)
        self._queue: deque = deque()  # (record, first chunk ns) or a built root span (dict)
        self._queued_spans = self._in_flight = 0
        self._closing = self._abandoned = False
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._drain, name="otlp-push", daemon=True)
        self._thread.start()

    def add(self, records: list[RequestRecord], first_chunk_ns: dict[str, int]) -> None:
        """Queue one flush's measured records (called on the load's loop: counts only)."""
        with self._lock:
            if self._closing:
                return
            for record in records:
                self.tally.add({c: getattr(record, c.value) for c in _TIME_COLUMNS})
                n = spans_of(record)
                if not n:
                    continue
                if self._queued_spans + n > self.max_queue_spans:
                    self.spans_dropped += n
                    continue
                self._queue.append((record, first_chunk_ns.get(record.request_id)))
                self._queued_spans += n
            self.max_queued_spans = max(self.max_queued_spans, self._queued_spans)
            if self._queued_spans >= self.batch_spans:
                self._lock.notify()

    def close(self, *, complete: bool) -> None:
        """Queue the root span and wait at most `drain_s` for everything to go out."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._queue.append(root_span(self.context, self.tally, complete=complete))
            self._queued_spans += 1
            self.max_queued_spans = max(self.max_queued_spans, self._queued_spans)
            self._lock.notify()
        self._thread.join(self.drain_s)
        with self._lock:
            if self._thread.is_alive():  # the collector is too slow: give up on the rest
                self._abandoned = True
                self.spans_dropped += self._queued_spans + self._in_flight
                self._queue.clear()
                self._queued_spans = self._in_flight = 0
                self.last_error = self.last_error or (
                    f"{self.endpoint.shown} did not take the run's last spans within "
                    f"{self.drain_s:g} s"
                )
                self._lock.notify()

    def manifest_changes(self) -> dict:
        """The manifest's `otlp` section (no header, no credential)."""
        with self._lock:
            return {
                "otlp": {
                    "endpoint": self.endpoint.shown,
                    "spans_sent": self.spans_sent,
                    "spans_dropped": self.spans_dropped,
                    "batches_failed": self.batches_failed,
                    "last_error": self.last_error,
                }
            }

    def warning(self) -> str | None:
        """One sentence when a span was dropped or a batch failed; None when all went out."""
        with self._lock:
            if not self.spans_dropped and not self.batches_failed:
                return None
            last = f" (last error: {self.last_error})" if self.last_error else ""
            return (
                f"the OTLP push to {self.endpoint.shown} sent {self.spans_sent} spans and "
                f"dropped {self.spans_dropped}, {self.batches_failed} batches failed{last}."
            )

    # The background thread ---------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(
                    lambda: self._closing or self._queued_spans >= self.batch_spans,
                    timeout=self.interval_s,
                )
                if self._abandoned or (self._closing and not self._queue):
                    return
                items, n = self._take()
                self._in_flight = n
            if items:
                self._send(items, n)

    def _take(self) -> tuple[list, int]:
        """Up to `batch_spans` spans' worth of queued items (at least one item)."""
        items, n = [], 0
        while self._queue:
            item = self._queue[0]
            size = 1 if isinstance(item, dict) else spans_of(item[0])
            if items and n + size > self.batch_spans:
                break
            items.append(self._queue.popleft())
            n += size
        self._queued_spans -= n
        return items, n

    def _send(self, items: list, n: int) -> None:
        records = [item for item in items if not isinstance(item, dict)]
        rows = requests_table([r for r, _ in records]).to_pylist() if records else []
        spans = [s for row, (_, first) in zip(rows, records, strict=True)
                 for s in request_spans(row, self.context, first)]  # fmt: skip
        spans += [item for item in items if isinstance(item, dict)]
        body = json.dumps(traces_document(self.context, spans)).encode()
        rejected, error = 0, None
        for attempt in range(self.retries + 1):
            try:
                rejected = min(self.post(self.endpoint, body, self.timeout_s), n)
                error = None
                break
            except PushError as exc:
                error = exc
                if not exc.retryable or attempt == self.retries:
                    break
                with self._lock:
                    if self._lock.wait_for(lambda: self._abandoned, FIRST_BACKOFF_S * 2**attempt):
                        return
        with self._lock:
            if self._abandoned:  # close already counted this batch as dropped
                return
            self._in_flight = 0
            if error is None:
                self.spans_sent += n - rejected
                self.spans_dropped += rejected
                if rejected:
                    self.last_error = f"{self.endpoint.shown} rejected {rejected} spans"
            else:
                self.batches_failed += 1
                self.spans_dropped += n
                self.last_error = str(error)
