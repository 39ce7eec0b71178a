"""The OpenAI-compatible HTTP client: one aiohttp session, one request path for every endpoint.

The hot path only stamps and stores socket reads; `harness.http.sse` parses them after the
request is done. Every failure is classified here into the run table's `status` and
`error_class`.
"""

from __future__ import annotations

import asyncio
import errno
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from harness.http.dense import dense_fields
from harness.http.events import TYPED_ENDPOINTS, endpoint_headers, typed_body_fields
from harness.http.transport import BaseTransport
from slo.runrecord import Endpoint, ErrorClass, RequestStatus
from workloads.constraint import request_fields


@dataclass(slots=True)
class RequestPayload:
    """One request as the client sends it: what the workload asked for, already in wire form."""

    request_id: str
    body: bytes
    is_warmup: bool = False
    headers: dict[str, str] | None = None  # this request's own headers (session affinity)


@dataclass(slots=True)
class RawResult:
    """Raw facts about one request; nanosecond times are `perf_counter_ns()` values (absolute)."""

    request_id: str
    is_warmup: bool
    t_scheduled_ns: int | None
    t_sent_ns: int | None = None
    t_first_byte_ns: int | None = None
    t_done_ns: int | None = None
    http_status: int | None = None
    reads: list[tuple[int, bytes]] = field(default_factory=list)
    body: bytes | None = None
    status: RequestStatus | None = None  # set only when the transport decided the outcome
    error_class: ErrorClass | None = None
    error_message: str | None = None
    engine_request_id: str | None = None  # the answer's x-request-id header
    worker: str | None = None  # the answer's x-bench-worker header (a cluster's router)


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How to talk to the target."""

    base_url: str
    model: str
    endpoint: Endpoint = Endpoint.COMPLETIONS
    stream: bool = True
    timeout_s: float = 600.0
    api_key: str | None = None
    headers: tuple[tuple[str, str], ...] = ()  # sent with every request, after Authorization
    extra_body: dict | None = None  # merged into every request body (`--extra-body`)
    chunk_usage: bool = False  # ask for the usage so far in every chunk (continuous usage)

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoint", Endpoint(self.endpoint))
        if not self.endpoint.generates:  # embeddings and rerank answer whole
            object.__setattr__(self, "stream", False)
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint.path

    @property
    def is_chat(self) -> bool:
        return self.endpoint is Endpoint.CHAT


DEADLINE_HEADER = "x-request-deadline-ms"


def request_headers(spec: dict) -> dict[str, str] | None:
    """One RequestSpec row's own headers: its deadline (ms after the request is sent) as
    `x-request-deadline-ms`; None when it has none."""
    deadline = spec.get("deadline_ms")
    return None if deadline is None else {DEADLINE_HEADER: str(int(deadline))}


def build_body(options: ClientOptions, spec: dict) -> bytes:
    """Encode one RequestSpec row (a dict) as the JSON body for the chosen endpoint.

    Copied to its own size: orjson's result keeps the 1 KiB buffer it wrote into, which a
    plan of many short bodies would otherwise hold (15 MB for 15,000 requests)."""
    return bytes(memoryview(orjson.dumps(body_fields(options, spec))))


def body_fields(options: ClientOptions, spec: dict) -> dict:
    """The JSON body of one RequestSpec row (a dict) for the chosen endpoint, as a dict."""
    if not options.endpoint.generates:
        return dense_fields(options.endpoint, options.model, spec, options.extra_body)
    if options.endpoint in TYPED_ENDPOINTS:
        typed = typed_body_fields(options.endpoint, options.model, spec, stream=options.stream)
        return {**typed, **(options.extra_body or {})}
    body: dict = {"model": options.model, "max_tokens": int(spec["max_output_tokens"])}
    if options.is_chat:
        body["messages"] = [{"role": "user", "content": spec["prompt"]}]
    else:
        body["prompt"] = spec["prompt"]
    if options.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if options.chunk_usage:
            body["stream_options"]["continuous_usage_stats"] = True
    if spec.get("ignore_eos"):
        body["ignore_eos"] = True
    for key in ("temperature", "top_p", "seed", "priority"):
        if spec.get(key) is not None:
            body[key] = spec[key]
    if spec.get("tenant") is not None:
        body["user"] = spec["tenant"]  # OpenAI's end-user field: the tenant
    if spec.get("constraint"):
        body.update(request_fields(spec["constraint"]))
    if spec.get("tools") is not None:
        body.update(spec["tools"].request_fields())  # a workloads.tools.ToolOffer
    if options.extra_body:
        body.update(options.extra_body)
    return body


def auth_headers(api_key: str | None, extra=()) -> dict[str, str]:
    """`Authorization: Bearer <api_key>` (when a key is given), then the `extra` (name, value)
    pairs (`--header`): the headers every request to the target carries."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    headers.update(extra)
    return headers


def make_session(options: ClientOptions, *, max_connections: int) -> aiohttp.ClientSession:
    """One session for the whole run, its connection pool sized to the concurrency."""
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, ttl_dns_cache=None)
    headers = {
        "Content-Type": "application/json",
        **endpoint_headers(options.endpoint, options.api_key),  # Messages: x-api-key
        **dict(options.headers),
    }
    return aiohttp.ClientSession(
        connector=connector,
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


class AiohttpTransport(BaseTransport):
    """The default transport (see `harness.http.transport.Transport`): one aiohttp session for
    the whole run, its connection pool sized to the concurrency. Use as an async context
    manager; `aclose` closes the session."""

    def __init__(self, options: ClientOptions, *, max_connections: int) -> None:
        self.options = options
        self.max_connections = max_connections
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AiohttpTransport:
        if self.session is None:  # entered again while open: the same session, none leaked
            self.session = make_session(self.options, max_connections=self.max_connections)
        return self

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        await send(self.session, self.options, payload, result)


async def send(
    session: aiohttp.ClientSession,
    options: ClientOptions,
    payload: RequestPayload,
    result: RawResult,
) -> None:
    """Send one request, filling `result` with its raw timeline.

    A failed request is recorded in `result`, never raised; only cancellation propagates (after
    `result` says `cancelled`), so the caller always has a record to keep.
    """
    clock = time.perf_counter_ns
    try:
        async with asyncio.timeout(options.timeout_s):
            result.t_sent_ns = clock()
            async with session.post(
                options.url, data=payload.body, headers=payload.headers
            ) as response:
                result.t_first_byte_ns = clock()
                result.http_status = response.status
                result.engine_request_id = response.headers.get("x-request-id")
                result.worker = response.headers.get("x-bench-worker")
                if response.status != 200:
                    result.body = await response.read()
                    _classify_http(result)
                elif options.stream:
                    reads = result.reads
                    readany = response.content.readany
                    while data := await readany():
                        reads.append((clock(), data))
                else:
                    result.body = await response.read()
                result.t_done_ns = clock()
    except TimeoutError:
        _set_error(
            result,
            RequestStatus.TIMEOUT,
            ErrorClass.TIMEOUT,
            f"no complete response within {options.timeout_s:g} s",
        )
    except asyncio.CancelledError:
        _set_error(
            result, RequestStatus.CANCELLED, None, "the run stopped while the request was in flight"
        )
        raise
    except aiohttp.ClientConnectorError as exc:
        refused = exc.os_error is not None and exc.os_error.errno == errno.ECONNREFUSED
        error_class = ErrorClass.CONNECTION_REFUSED if refused else ErrorClass.CONNECTION_ERROR
        _set_error(result, RequestStatus.ERROR, error_class, _one_line(exc))
    except (
        aiohttp.ServerDisconnectedError,
        aiohttp.ClientPayloadError,
        ConnectionResetError,
    ) as exc:
        # The request went out and the connection broke before a terminal event: the server
        # may have done the work, so the outcome is unknown, not a plain error.
        _set_error(result, RequestStatus.UNKNOWN, ErrorClass.CONNECTION_RESET, _one_line(exc))
    except aiohttp.ClientOSError as exc:
        reset = exc.errno in (errno.ECONNRESET, errno.EPIPE)
        if reset:
            _set_error(result, RequestStatus.UNKNOWN, ErrorClass.CONNECTION_RESET, _one_line(exc))
        else:
            _set_error(result, RequestStatus.ERROR, ErrorClass.CLIENT_ERROR, _one_line(exc))
    except aiohttp.ClientError as exc:
        _set_error(result, RequestStatus.ERROR, ErrorClass.CLIENT_ERROR, _one_line(exc))
    finally:
        if result.t_done_ns is None:
            result.t_done_ns = clock()


def _classify_http(result: RawResult) -> None:
    status = result.http_status or 0
    message = _error_message(result.body or b"")
    if status == 429:
        _set_error(result, RequestStatus.REJECTED, ErrorClass.REJECTED_429, message)
    elif 400 <= status < 500:
        _set_error(result, RequestStatus.ERROR, ErrorClass.HTTP_4XX, message)
    else:
        _set_error(result, RequestStatus.ERROR, ErrorClass.HTTP_5XX, message)


def _error_message(body: bytes) -> str:
    try:
        obj = orjson.loads(body)
        error = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(error, dict):
            return str(error.get("message", error))[:300]
        return str(error)[:300]
    except (orjson.JSONDecodeError, AttributeError):
        return body[:300].decode("utf-8", "replace")


def _set_error(
    result: RawResult, status: RequestStatus, error_class: ErrorClass | None, message: str
) -> None:
    result.status = status
    result.error_class = error_class
    result.error_message = message


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}".splitlines()[0][:300]
