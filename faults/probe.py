"""`bench probe bad-input`: send every bad request in `probe_cases` to an OpenAI-compatible
server and check that each gets an acceptable answer and leaves the server well.

Before the first case the probe records a reference answer: a short greedy completion
(`temperature` 0, `max_tokens` 8), asked twice, which must agree. After every case it checks
that the server is healthy (`GET /health` 200, or `GET /v1/models` 200 for servers without
/health) and still gives the reference answer. Meanwhile `num_streams` background streams ask
the same request streamed, over and over, and each must end with the reference text.

Requests go over raw asyncio sockets (a body of invalid UTF-8, a 100 KiB header or a chunked
64 MiB body are beyond a polite HTTP client), one `Connection: close` exchange per request,
each bounded by `timeout_s`. A server that stops answering ends the probe: the cases not yet
run are reported as failed, with the case after which it went down.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from faults.probe_cases import (
    COMPLETIONS,
    JSON_TYPE,
    MODELS,
    Category,
    Expect,
    LazyBody,
    ProbeCase,
    build_cases,
)
from harness.sse import parse_body, parse_stream

REFERENCE_PROMPT = "The quick brown fox"
_HEAD_LIMIT_BYTES = 1024 * 1024
_BODY_LIMIT_BYTES = 8 * 1024 * 1024
_EXCERPT_CHARS = 200
_MAX_STREAM_FAILURES_KEPT = 20


class ProbeError(Exception):
    """The probe cannot start (bad URL, server unreachable or unhealthy, no model); one sentence."""


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"


class HealthAfter(StrEnum):
    """The server's state after a case: well, answering but unhealthy, giving another answer
    to the reference request, not answering at all, or not checked (the case did not run)."""

    OK = "ok"
    UNHEALTHY = "unhealthy"
    WRONG_ANSWER = "wrong-answer"
    DOWN = "down"
    NOT_CHECKED = "not-checked"


class Outcome(StrEnum):
    ANSWERED = "answered"
    CLOSED = "closed"  # the server closed the connection before an HTTP answer
    TIMED_OUT = "timed-out"
    UNREACHABLE = "unreachable"
    NOT_HTTP = "not-http"


@dataclass(frozen=True)
class ProbeConfig:
    """What to probe. `url` is the server root or its `/v1` base; `model` None means the first
    id `/v1/models` lists; `timeout_s` bounds every request; `only` empty runs every category."""

    url: str
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 10.0
    only: frozenset[Category] = frozenset()
    num_streams: int = 2

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ProbeError(
                f"--url {self.url!r} is not an http(s) URL such as http://127.0.0.1:8000."
            )
        if not self.timeout_s > 0:
            raise ProbeError(f"--timeout must be positive, got {self.timeout_s}.")
        if self.num_streams < 0:
            raise ProbeError(f"num_streams must be non-negative, got {self.num_streams}.")


@dataclass(frozen=True)
class HttpAnswer:
    """What one exchange got: `status` and `body` when `outcome` is ANSWERED."""

    outcome: Outcome
    elapsed_ms: float
    status: int | None = None
    body: bytes = b""
    detail: str = ""


@dataclass(frozen=True)
class CaseResult:
    name: str
    category: Category
    request: str
    status: int | None
    body_excerpt: str
    verdict: Verdict
    reason: str
    health_after: HealthAfter
    latency_ms: float | None


@dataclass(frozen=True)
class StreamFailure:
    """A background stream that did not end with the reference text, and the cases that ran
    while it was in flight."""

    reason: str
    during: tuple[str, ...]


@dataclass(frozen=True)
class StreamsResult:
    num_streams: int
    num_completed: int
    num_failed: int
    failures: tuple[StreamFailure, ...]  # the first few
    max_latency_ms: float | None

    @property
    def passed(self) -> bool:
        return self.num_failed == 0


@dataclass(frozen=True)
class ProbeReport:
    url: str
    model: str
    health_path: str
    reference_text: str
    results: tuple[CaseResult, ...]
    streams: StreamsResult

    @property
    def failed(self) -> tuple[CaseResult, ...]:
        return tuple(r for r in self.results if r.verdict is Verdict.FAIL)

    @property
    def passed(self) -> bool:
        return not self.failed and self.streams.passed

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "health_path": self.health_path,
            "reference_text": self.reference_text,
            "passed": self.passed,
            "num_cases": len(self.results),
            "num_failed": len(self.failed),
            "cases": [asdict(r) for r in self.results],
            "streams": {**asdict(self.streams), "passed": self.streams.passed},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)


def judge(expect: Expect, answer: HttpAnswer, *, timeout_s: float) -> tuple[Verdict, str]:
    """The verdict on one answer, and why, in one sentence (health is judged separately)."""
    status = answer.status
    if answer.outcome is Outcome.TIMED_OUT:
        return Verdict.FAIL, f"no answer within {timeout_s:g} s."
    if answer.outcome is Outcome.UNREACHABLE:
        return Verdict.FAIL, f"could not connect ({answer.detail})."
    if answer.outcome is Outcome.NOT_HTTP:
        return Verdict.FAIL, f"answered something that is not HTTP ({answer.detail})."
    if answer.outcome is Outcome.CLOSED:
        if expect.close_allowed:
            return Verdict.PASS, "closed the connection without an answer, which this case allows."
        return Verdict.FAIL, "closed the connection without answering."
    assert status is not None
    due = "a 4xx or a completion" if expect.ok_allowed else "a 4xx"
    if status >= 500:
        return Verdict.FAIL, f"answered {status}, a server error, where {due} was due."
    if 400 <= status < 500:
        if not expect.error_body_required:
            return Verdict.PASS, f"rejected with {status}."
        if is_error_body(answer.body):
            return Verdict.PASS, f"rejected with {status} and an OpenAI error body."
        return Verdict.FAIL, (
            f'rejected with {status} but the body is not an OpenAI error {{"error": {{"message": ...}}}}.'
        )
    if 200 <= status < 300:
        if not expect.ok_allowed:
            return (
                Verdict.FAIL,
                f"accepted with {status} a request that must be rejected with a 4xx.",
            )
        if is_completion_body(answer.body):
            return Verdict.PASS, f"accepted with {status} and a well-formed completion."
        return (
            Verdict.FAIL,
            f"answered {status} but the body is not a completion (no choices list).",
        )
    return Verdict.FAIL, f"answered {status} where {due} was due."


def is_error_body(body: bytes) -> bool:
    """True for `{"error": {"message": <str>, ...}}`."""
    obj = _json_or_none(body)
    error = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def is_completion_body(body: bytes) -> bool:
    obj = _json_or_none(body)
    return isinstance(obj, dict) and isinstance(obj.get("choices"), list)


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


class _Server:
    """Raw HTTP/1.1 exchanges with one server: a request written as given, the answer read."""

    def __init__(self, url: str, api_key: str | None) -> None:
        parts = urlsplit(url)
        self.is_tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.is_tls else 80)
        root = parts.path.rstrip("/")
        self.root = root[: -len("/v1")] if root.endswith("/v1") else root
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = f"{host}:{self.port}"
        self.auth = (("Authorization", f"Bearer {api_key}"),) if api_key else ()

    async def send(
        self,
        method: str,
        path: str,
        *,
        timeout_s: float,
        body: bytes | LazyBody = b"",
        content_type: str | None = JSON_TYPE,
        headers: Iterable[tuple[str, str]] = (),
    ) -> HttpAnswer:
        t0_ns = time.perf_counter_ns()
        try:
            async with asyncio.timeout(timeout_s):
                outcome, status, data, detail = await self._exchange(
                    method, path, body, content_type, headers
                )
        except TimeoutError:
            outcome, status, data, detail = Outcome.TIMED_OUT, None, b"", ""
        elapsed_ms = (time.perf_counter_ns() - t0_ns) / 1e6
        return HttpAnswer(outcome, elapsed_ms, status, data, detail)

    def _head(self, method, path, body, content_type, headers) -> bytes:
        lines = [f"{method} {self.root}{path} HTTP/1.1", f"Host: {self.host_header}"]
        lines += ["Connection: close", "Accept: */*"]
        lines += [f"{k}: {v}" for k, v in (*self.auth, *headers)]
        if content_type is not None:
            lines.append(f"Content-Type: {content_type}")
        if isinstance(body, LazyBody) and body.size is None:
            lines.append("Transfer-Encoding: chunked")
        elif isinstance(body, LazyBody) or body or method in ("POST", "PUT", "PATCH"):
            lines.append(
                f"Content-Length: {body.size if isinstance(body, LazyBody) else len(body)}"
            )
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _exchange(self, method, path, body, content_type, headers):
        context = ssl.create_default_context() if self.is_tls else None
        try:
            reader, writer = await asyncio.open_connection(
                self.host, self.port, ssl=context, limit=_HEAD_LIMIT_BYTES
            )
        except ConnectionRefusedError:
            return Outcome.UNREACHABLE, None, b"", "connection refused"
        except OSError as exc:
            return Outcome.UNREACHABLE, None, b"", exc.strerror or str(exc)
        head = self._head(method, path, body, content_type, headers)
        # The request is written while the answer is read: a server may answer (413) and stop
        # reading before a huge body is all sent.
        sender = asyncio.create_task(_write(writer, head, body))
        try:
            return await _read_answer(reader)
        finally:
            sent = sender.done() and not sender.cancelled() and sender.result()
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            if sent:
                writer.close()
            else:  # unsent bytes would hold a graceful close open
                writer.transport.abort()


async def _write(writer: asyncio.StreamWriter, head: bytes, body: bytes | LazyBody) -> bool:
    """Write the request; False when the server closed the connection before it all went."""
    try:
        writer.write(head)
        if isinstance(body, LazyBody):
            chunked = body.size is None
            for piece in body.pieces():
                if piece:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                    await writer.drain()
            if chunked:
                writer.write(b"0\r\n\r\n")
        else:
            writer.write(body)
        await writer.drain()
        return True
    except OSError:  # ConnectionResetError, BrokenPipeError
        return False


async def _read_answer(reader: asyncio.StreamReader) -> tuple[Outcome, int | None, bytes, str]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            return (
                Outcome.NOT_HTTP,
                None,
                b"",
                f"the answer ended inside its head: {exc.partial[:60]!r}",
            )
        return Outcome.CLOSED, None, b"", ""
    except asyncio.LimitOverrunError:
        return Outcome.NOT_HTTP, None, b"", "an answer head over 1 MiB"
    except OSError:
        return Outcome.CLOSED, None, b"", ""
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/") or not code.isdigit():
        return Outcome.NOT_HTTP, None, b"", f"status line {status_line[:60]!r}"
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    try:
        body = await _read_body(reader, headers)
    except (asyncio.IncompleteReadError, OSError, ValueError):
        body = b""  # the body was cut short; the status alone is the answer
    return Outcome.ANSWERED, int(code), body, ""


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts, total = [], 0
        while total < _BODY_LIMIT_BYTES:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                break
            parts.append(await reader.readexactly(size))
            total += size
            await reader.readexactly(2)
        return b"".join(parts)
    if "content-length" in headers:
        length = min(int(headers["content-length"]), _BODY_LIMIT_BYTES)
        return await reader.readexactly(length)
    return await reader.read(_BODY_LIMIT_BYTES)


@dataclass(frozen=True)
class _Target:
    server: _Server
    model: str
    health_path: str
    reference_text: str
    timeout_s: float

    def reference_body(self, *, stream: bool) -> bytes:
        body = {"model": self.model, "prompt": REFERENCE_PROMPT, "max_tokens": 8, "temperature": 0}
        return json.dumps({**body, "stream": True} if stream else body).encode()


async def run_probe(
    config: ProbeConfig, *, on_result: Callable[[CaseResult], None] | None = None
) -> ProbeReport:
    """Run every selected case with the background streams; raises ProbeError when the server
    cannot be probed at all (then nothing was sent but the pre-flight requests)."""
    target = await _prepare(config)
    cases = [c for c in build_cases(target.model) if not config.only or c.category in config.only]
    stop = asyncio.Event()
    spans: list[tuple[int, int, str]] = []  # (start_ns, end_ns, case name) per case that ran
    streams = [asyncio.create_task(_stream_until(target, stop)) for _ in range(config.num_streams)]
    try:
        results = await _run_cases(target, cases, spans, on_result)
    finally:
        stop.set()
        tallies = await asyncio.gather(*streams)
    return ProbeReport(
        url=config.url,
        model=target.model,
        health_path=target.health_path,
        reference_text=target.reference_text,
        results=tuple(results),
        streams=_streams_result(config.num_streams, tallies, spans),
    )


async def _prepare(config: ProbeConfig) -> _Target:
    server = _Server(config.url, config.api_key)
    timeout_s = config.timeout_s
    health = await server.send("GET", "/health", timeout_s=timeout_s, content_type=None)
    if health.outcome is not Outcome.ANSWERED:
        why = health.detail or health.outcome.value.replace("-", " ")
        raise ProbeError(
            f"Cannot reach {config.url} ({why}); check --url and that the server runs."
        )
    health_path = "/health"
    if health.status in (404, 405):
        health_path = MODELS
        health = await server.send("GET", MODELS, timeout_s=timeout_s, content_type=None)
    if health.status != 200:
        raise ProbeError(
            f"{config.url} is not healthy before the probe: GET {health_path} answered {health.status}."
        )
    model = config.model or await _first_model(server, config)
    target = _Target(server, model, health_path, "", timeout_s)
    texts = []
    for _ in range(2):
        text, health, problem = await _reference_answer(target)
        if health is not HealthAfter.OK:
            raise ProbeError(
                f"The well-formed reference request failed before the probe: {problem}; check --model and --api-key."
            )
        texts.append(text)
    if texts[0] != texts[1]:
        raise ProbeError(
            f"The server answered the same greedy request differently ({texts[0]!r}, then {texts[1]!r}), so answers after each case cannot be checked."
        )
    return _Target(server, model, health_path, texts[0], timeout_s)


async def _first_model(server: _Server, config: ProbeConfig) -> str:
    answer = await server.send("GET", MODELS, timeout_s=config.timeout_s, content_type=None)
    obj = _json_or_none(answer.body) if answer.status == 200 else None
    data = obj.get("data") if isinstance(obj, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and "id" in data[0]:
        return str(data[0]["id"])
    hint = "pass --api-key" if answer.status in (401, 403) else "pass --model"
    raise ProbeError(f"GET /v1/models did not list a model (status {answer.status}); {hint}.")


async def _reference_answer(target: _Target) -> tuple[str, HealthAfter, str]:
    """The reference request's text; when it fails, DOWN (no answer) or UNHEALTHY (a wrong
    status or body), and a sentence fragment saying how."""
    answer = await target.server.send(
        "POST", COMPLETIONS, timeout_s=target.timeout_s, body=target.reference_body(stream=False)
    )
    if answer.outcome is not Outcome.ANSWERED:
        return "", HealthAfter.DOWN, _no_answer("the reference request", answer, target.timeout_s)
    if answer.status != 200:
        return "", HealthAfter.UNHEALTHY, f"the reference request answered {answer.status}"
    parsed = parse_body(answer.body, chat=False)
    if parsed.error_message is not None:
        problem = f"the reference request's answer is malformed ({parsed.error_message})"
        return "", HealthAfter.UNHEALTHY, problem
    return parsed.text, HealthAfter.OK, ""


def _no_answer(what: str, answer: HttpAnswer, timeout_s: float) -> str:
    if answer.outcome is Outcome.TIMED_OUT:
        return f"{what} got no answer within {timeout_s:g} s"
    if answer.outcome is Outcome.UNREACHABLE:
        return f"{what} could not connect ({answer.detail})"
    return f"{what} got no HTTP answer ({answer.outcome.value.replace('-', ' ')})"


async def _check_after(target: _Target) -> tuple[HealthAfter, str]:
    """Whether the server is still well, and if not, a sentence fragment saying how not."""
    health = await target.server.send(
        "GET", target.health_path, timeout_s=target.timeout_s, content_type=None
    )
    what = f"GET {target.health_path}"
    if health.outcome is not Outcome.ANSWERED:
        return HealthAfter.DOWN, _no_answer(what, health, target.timeout_s)
    if health.status != 200:
        return HealthAfter.UNHEALTHY, f"{what} answered {health.status}"
    text, health, problem = await _reference_answer(target)
    if health is not HealthAfter.OK:
        return health, problem
    if text != target.reference_text:
        return HealthAfter.WRONG_ANSWER, (
            f"the reference request answered {text!r} instead of {target.reference_text!r}"
        )
    return HealthAfter.OK, ""


async def _run_cases(
    target: _Target,
    cases: list[ProbeCase],
    spans: list[tuple[int, int, str]],
    on_result: Callable[[CaseResult], None] | None,
) -> list[CaseResult]:
    results: list[CaseResult] = []
    down_after: str | None = None
    for case in cases:
        if down_after is not None:
            result = _not_run(case, down_after)
        else:
            start_ns = time.monotonic_ns()
            result = await _run_case(target, case)
            spans.append((start_ns, time.monotonic_ns(), case.name))
            if result.health_after is HealthAfter.DOWN:
                down_after = case.name
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


async def _run_case(target: _Target, case: ProbeCase) -> CaseResult:
    answer = await target.server.send(
        case.method,
        case.path,
        timeout_s=target.timeout_s,
        body=case.body,
        content_type=case.content_type,
        headers=case.headers,
    )
    verdict, reason = judge(case.expect, answer, timeout_s=target.timeout_s)
    health, problem = await _check_after(target)
    if health is not HealthAfter.OK:
        joint = ", but afterwards" if verdict is Verdict.PASS else "; afterwards"
        verdict, reason = Verdict.FAIL, f"{reason[:-1]}{joint} {problem}."
    return CaseResult(
        name=case.name,
        category=case.category,
        request=describe(case),
        status=answer.status,
        body_excerpt=_excerpt(answer.body),
        verdict=verdict,
        reason=reason,
        health_after=health,
        latency_ms=round(answer.elapsed_ms, 3),
    )


def _not_run(case: ProbeCase, down_after: str) -> CaseResult:
    return CaseResult(
        name=case.name,
        category=case.category,
        request=describe(case),
        status=None,
        body_excerpt="",
        verdict=Verdict.FAIL,
        reason=f"not run: the server stopped answering after case {down_after!r}.",
        health_after=HealthAfter.NOT_CHECKED,
        latency_ms=None,
    )


def describe(case: ProbeCase) -> str:
    """One line for a report: method, path, what is odd about the request, body size."""
    size = case.body_size
    if size is None:
        size_text = "chunked"
    elif size >= 2**20:
        size_text = f"{size / 2**20:.1f} MiB"
    elif size >= 2**10:
        size_text = f"{size / 2**10:.1f} KiB"
    else:
        size_text = f"{size} B"
    return f"{case.method} {case.path}: {case.summary} ({size_text})"


def _excerpt(body: bytes) -> str:
    text = " ".join(body[: _EXCERPT_CHARS * 4].decode("utf-8", "replace").split())
    return text if len(text) <= _EXCERPT_CHARS else text[: _EXCERPT_CHARS - 3] + "..."


@dataclass
class _StreamTally:
    num_completed: int = 0
    failures: list[tuple[int, int, str]] = field(default_factory=list)  # (start_ns, end_ns, why)
    max_latency_ms: float | None = None


async def _stream_until(target: _Target, stop: asyncio.Event) -> _StreamTally:
    """Streamed reference requests, one after another, until `stop` (at least one)."""
    tally = _StreamTally()
    body = target.reference_body(stream=True)
    while True:
        start_ns = time.monotonic_ns()
        answer = await target.server.send(
            "POST", COMPLETIONS, timeout_s=target.timeout_s, body=body
        )
        problem = _stream_problem(answer, target)
        if problem is None:
            tally.num_completed += 1
            tally.max_latency_ms = max(tally.max_latency_ms or 0.0, answer.elapsed_ms)
        else:
            tally.failures.append((start_ns, time.monotonic_ns(), problem))
            await asyncio.sleep(0.05)  # a server that is down refuses at once; do not spin
        if stop.is_set():
            return tally


def _stream_problem(answer: HttpAnswer, target: _Target) -> str | None:
    if answer.outcome is not Outcome.ANSWERED:
        return _no_answer("a background stream", answer, target.timeout_s)
    if answer.status != 200:
        return f"a background stream answered {answer.status}"
    parsed = parse_stream([(0, answer.body)], chat=False)
    if parsed.error_message is not None:
        return f"a background stream broke: {parsed.error_message}"
    if parsed.text != target.reference_text:
        return f"a background stream said {parsed.text!r} instead of {target.reference_text!r}"
    return None


def _streams_result(
    num_streams: int, tallies: list[_StreamTally], spans: list[tuple[int, int, str]]
) -> StreamsResult:
    failures = sorted(f for tally in tallies for f in tally.failures)
    latencies = [t.max_latency_ms for t in tallies if t.max_latency_ms is not None]
    kept = tuple(
        StreamFailure(why, tuple(name for s, e, name in spans if s < end and e > start))
        for start, end, why in failures[:_MAX_STREAM_FAILURES_KEPT]
    )
    return StreamsResult(
        num_streams=num_streams,
        num_completed=sum(t.num_completed for t in tallies),
        num_failed=len(failures),
        failures=kept,
        max_latency_ms=round(max(latencies), 3) if latencies else None,
    )
