"""`bench probe bad-input`: send every bad request in `probe_cases` to an OpenAI-compatible
server and check that each gets an acceptable answer and leaves the server well.

Before the first case the probe records a reference answer: a short greedy completion
(`temperature` 0, `max_tokens` 8), asked twice, which must agree. After every case it checks
that the server is healthy (`GET /health` 200, or `GET /v1/models` 200 for servers without
/health) and still gives the reference answer. Meanwhile `num_streams` background streams ask
the same request streamed, over and over, and each must end with the reference text
(`probe_streams`). A route the server does not serve (`probe_routes`: the Responses or
Messages API answering a well-formed request 404) has its cases reported as not served.

Requests go over raw asyncio sockets (`raw_http`: a body of invalid UTF-8, a 100 KiB header or
a chunked 64 MiB body are beyond a polite HTTP client), one `Connection: close` exchange per
request, each bounded by `timeout_s`. A server that stops answering ends the probe: the cases
not yet run are reported as failed, with the case after which it went down. The results are
data (`probe_report`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from faults.probe_cases import build_cases
from faults.probe_cases.case import COMPLETIONS, MODELS, Category, Expect, ProbeCase
from faults.probe_report import CaseResult, HealthAfter, ProbeReport, Verdict
from faults.probe_routes import unserved_routes
from faults.probe_streams import stream_until, streams_result
from faults.raw_http import HttpAnswer, Outcome, RawServer, no_answer_reason
from harness.http.sse import parse_body

REFERENCE_PROMPT = "The quick brown fox"
_EXCERPT_CHARS = 200


class ProbeError(Exception):
    """The probe cannot start (bad URL, server unreachable or unhealthy, no model); one sentence."""


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


@dataclass(frozen=True)
class _Target:
    server: RawServer
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
    body = target.reference_body(stream=True)
    streams = [
        asyncio.create_task(
            stream_until(
                target.server,
                body,
                stop,
                reference_text=target.reference_text,
                timeout_s=target.timeout_s,
            )
        )
        for _ in range(config.num_streams)
    ]
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
        streams=streams_result(config.num_streams, tallies, spans),
    )


async def _prepare(config: ProbeConfig) -> _Target:
    server = RawServer(config.url, config.api_key)
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


async def _first_model(server: RawServer, config: ProbeConfig) -> str:
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
        return (
            "",
            HealthAfter.DOWN,
            no_answer_reason("the reference request", answer, target.timeout_s),
        )
    if answer.status != 200:
        return "", HealthAfter.UNHEALTHY, f"the reference request answered {answer.status}"
    parsed = parse_body(answer.body, chat=False)
    if parsed.error_message is not None:
        problem = f"the reference request's answer is malformed ({parsed.error_message})"
        return "", HealthAfter.UNHEALTHY, problem
    return parsed.text, HealthAfter.OK, ""


async def _check_after(target: _Target) -> tuple[HealthAfter, str]:
    """Whether the server is still well, and if not, a sentence fragment saying how not."""
    health = await target.server.send(
        "GET", target.health_path, timeout_s=target.timeout_s, content_type=None
    )
    what = f"GET {target.health_path}"
    if health.outcome is not Outcome.ANSWERED:
        return HealthAfter.DOWN, no_answer_reason(what, health, target.timeout_s)
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
    paths = {case.path for case in cases}
    unserved = await unserved_routes(target.server, target.model, paths, timeout_s=target.timeout_s)
    # the check requests went out too: the server must be well after them
    health_after, problem = await _check_after(target) if unserved else (HealthAfter.OK, "")
    for case in cases:
        if down_after is not None:
            result = _not_run(case, down_after)
        elif case.path in unserved:
            result = _not_served(case, unserved[case.path], health_after, problem)
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


def _not_served(case: ProbeCase, reason: str, health: HealthAfter, problem: str) -> CaseResult:
    verdict = Verdict.NOT_SERVED
    if health is not HealthAfter.OK:
        verdict, reason = Verdict.FAIL, f"{reason[:-1]}, but afterwards {problem}."
    return CaseResult(
        name=case.name,
        category=case.category,
        request=describe(case),
        status=None,
        body_excerpt="",
        verdict=verdict,
        reason=reason,
        health_after=health,
        latency_ms=None,
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
