"""An in-process `harness.http.transport.Transport` for tests: scripted responses, no sockets.

`FakeTransport` fills `RawResult` the way `harness.http.client.send` does (the same timestamps,
reads as `(perf_counter_ns, bytes)`, status and error class only for failures the transport decides),
so `harness.load.records.to_rows` turns its results into the records a real run would write. It also
records what was sent and how many requests were in flight at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

from harness.http.client import RawResult, RequestPayload
from harness.http.transport import BaseTransport
from slo.runrecord import ErrorClass, RequestStatus

DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Stream:
    """A 200 streamed response: headers after `first_byte_s`, then each `(delay_s, data)` read.

    `fail_with` ends the response after the reads with a failure the transport sees (a
    connection reset, say), as `send` records it: status `error`, that error class.
    """

    reads: Sequence[tuple[float, bytes]]
    first_byte_s: float = 0.0
    fail_with: ErrorClass | None = None


@dataclass(frozen=True)
class Body:
    """A 200 non-streamed response: headers after `first_byte_s`, the JSON body after `body_s`."""

    body: bytes
    first_byte_s: float = 0.0
    body_s: float = 0.0


@dataclass(frozen=True)
class HttpError:
    """An HTTP error status with an OpenAI-style JSON error body carrying `message`."""

    status: int
    message: str
    first_byte_s: float = 0.0

    @property
    def body(self) -> bytes:
        error = {"message": self.message, "type": "error", "param": None, "code": self.status}
        return orjson.dumps({"error": error})


@dataclass(frozen=True)
class ConnectFailure:
    """No response at all: the connection failed `after_s` seconds after the request went out."""

    error_class: ErrorClass = ErrorClass.CONNECTION_REFUSED
    after_s: float = 0.0


Outcome = Stream | Body | HttpError | ConnectFailure


@dataclass(frozen=True)
class SentRequest:
    """What the fake was asked to send. `sender` names the asyncio task that sent it: in a
    closed loop that is one user, in an open loop one task per request."""

    request_id: str
    body: bytes
    t_sent_ns: int
    sender: str


def sse_event(obj: dict) -> bytes:
    """One server-sent event carrying `obj` as JSON, as an OpenAI server writes it."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def openai_events(
    texts: Sequence[str],
    *,
    chat: bool = False,
    usage: dict | None = None,
    finish_reason: str = "length",
    done: bool = True,
) -> list[bytes]:
    """The events of an OpenAI-style stream: (for chat) a role-only event, one event per text,
    the last with `finish_reason`, a usage-only event when `usage` is given, then `[DONE]`."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list) -> dict:
        return {"id": "fake", "object": kind, "created": 0, "model": "fake", "choices": choices}

    events = []
    if chat:
        role = {"role": "assistant", "content": ""}
        events.append(sse_event(chunk([{"index": 0, "delta": role, "finish_reason": None}])))
    for i, text in enumerate(texts):
        reason = finish_reason if i == len(texts) - 1 else None
        choice = {"index": 0, "finish_reason": reason}
        choice.update({"delta": {"content": text}} if chat else {"text": text})
        events.append(sse_event(chunk([choice])))
    if usage is not None:
        events.append(sse_event({**chunk([]), "usage": usage}))
    if done:
        events.append(DONE_EVENT)
    return events


def stream(
    texts: Sequence[str],
    *,
    first_byte_s: float = 0.0,
    itl_s: float = 0.0,
    chat: bool = False,
    usage: dict | None = None,
    done: bool = True,
    fail_with: ErrorClass | None = None,
) -> Stream:
    """A `Stream` of `openai_events(...)`, one read per event, each `itl_s` after the last."""
    events = openai_events(texts, chat=chat, usage=usage, done=done)
    return Stream([(itl_s, event) for event in events], first_byte_s, fail_with)


def completion_body(text: str, *, chat: bool = False, usage: dict | None = None) -> bytes:
    """A non-streamed OpenAI response body holding `text`."""
    choice = {"index": 0, "finish_reason": "length"}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    body = {"id": "fake", "object": "completion", "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    return orjson.dumps(body)


class FakeTransport(BaseTransport):
    """Answers each request with `script(payload)` (or `script` itself when it is an Outcome).

    `timeout_s` bounds each request like `ClientOptions.timeout_s` does; None is no bound.
    """

    def __init__(
        self,
        script: Outcome | Callable[[RequestPayload], Outcome],
        *,
        timeout_s: float | None = None,
    ) -> None:
        self.script = script
        self.timeout_s = timeout_s
        self.sent: list[SentRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def outcome_for(self, payload: RequestPayload) -> Outcome:
        return self.script(payload) if callable(self.script) else self.script

    async def wait_for_in_flight(self, count: int, *, poll_s: float = 0.001) -> None:
        """Return once at least `count` requests are in flight (bound it with asyncio.timeout)."""
        while self.in_flight < count:
            await asyncio.sleep(poll_s)

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        outcome = self.outcome_for(payload)
        clock = time.perf_counter_ns
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            async with asyncio.timeout(self.timeout_s):
                result.t_sent_ns = clock()
                sender = asyncio.current_task().get_name()
                self.sent.append(
                    SentRequest(payload.request_id, payload.body, result.t_sent_ns, sender)
                )
                await _respond(outcome, result, clock)
        except TimeoutError:
            _set_error(
                result,
                RequestStatus.TIMEOUT,
                ErrorClass.TIMEOUT,
                f"no complete response within {self.timeout_s:g} s",
            )
        except asyncio.CancelledError:
            _set_error(
                result,
                RequestStatus.CANCELLED,
                None,
                "the run stopped while the request was in flight",
            )
            raise
        finally:
            if result.t_done_ns is None:
                result.t_done_ns = clock()
            self.in_flight -= 1


async def _respond(outcome: Outcome, result: RawResult, clock: Callable[[], int]) -> None:
    if isinstance(outcome, ConnectFailure):
        await asyncio.sleep(outcome.after_s)
        _set_error(
            result, RequestStatus.ERROR, outcome.error_class, "FakeConnectionError: scripted"
        )
        return
    await asyncio.sleep(outcome.first_byte_s)
    result.t_first_byte_ns = clock()
    if isinstance(outcome, HttpError):
        result.http_status = outcome.status
        result.body = outcome.body
        _classify_http(result, outcome)
    elif isinstance(outcome, Body):
        result.http_status = 200
        await asyncio.sleep(outcome.body_s)
        result.body = outcome.body
    else:
        result.http_status = 200
        for delay_s, data in outcome.reads:
            await asyncio.sleep(delay_s)
            result.reads.append((clock(), data))
        if outcome.fail_with is not None:
            # As `send`: a connection broken after the request went out leaves it `unknown`.
            cut = outcome.fail_with is ErrorClass.CONNECTION_RESET
            status = RequestStatus.UNKNOWN if cut else RequestStatus.ERROR
            _set_error(result, status, outcome.fail_with, "FakeStreamError: scripted")
            return
    result.t_done_ns = clock()


def _classify_http(result: RawResult, outcome: HttpError) -> None:
    if outcome.status == 429:
        _set_error(result, RequestStatus.REJECTED, ErrorClass.REJECTED_429, outcome.message)
    elif 400 <= outcome.status < 500:
        _set_error(result, RequestStatus.ERROR, ErrorClass.HTTP_4XX, outcome.message)
    else:
        _set_error(result, RequestStatus.ERROR, ErrorClass.HTTP_5XX, outcome.message)


def _set_error(
    result: RawResult, status: RequestStatus, error_class: ErrorClass | None, message: str
) -> None:
    result.status = status
    result.error_class = error_class
    result.error_message = message
