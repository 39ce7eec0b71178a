"""Client retries: the transport that resends an answer whose status the `RetryPolicy` names,
the record of each attempt, and the Retry-After values it waits by."""

from __future__ import annotations

import asyncio
import email.utils
import time
from dataclasses import dataclass, fields, replace

from faults.retry import RetryPolicy
from faults.wrapper import TransportWrapper
from harness.http.client import RawResult, RequestPayload
from harness.http.transport import Transport
from slo.runrecord import ErrorClass, RequestStatus


class RetryAfterLog:
    """The Retry-After of each request's latest error answer, in seconds, noted by
    `FaultAiohttpTransport` and taken by `RetryingTransport`."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    def note(self, request_id: str, header: str | None) -> None:
        seconds = parse_retry_after(header)
        if seconds is not None:
            self._seconds[request_id] = seconds

    def take(self, request_id: str) -> float | None:
        return self._seconds.pop(request_id, None)


def parse_retry_after(header: str | None, *, now_s: float | None = None) -> float | None:
    """Seconds from a Retry-After value: delay-seconds ("1", "0.5") or an HTTP date (its
    distance from `now_s`, default the wall clock, never negative); None when unreadable."""
    if not header:
        return None
    try:
        return max(float(header), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(header)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - (time.time() if now_s is None else now_s), 0.0)


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One attempt of a retried request; times are `perf_counter_ns()` values (absolute).
    `status` is None when the transport left the outcome to the stream parser (a 200 answer);
    `wait_s` is the pause before the next attempt (None for the last)."""

    attempt: int
    t_sent_ns: int | None
    t_done_ns: int | None
    http_status: int | None
    status: RequestStatus | None
    error_class: ErrorClass | None
    retry_after_s: float | None = None
    wait_s: float | None = None


class RetryingTransport(TransportWrapper):
    """Resends a request whose answer's HTTP status is in `policy.statuses`, up to
    `policy.max_attempts` attempts, waiting `policy.wait_s` (Retry-After when known) between
    them; passes everything straight through when `policy.enabled` is false.

    Ledger decision: the caller's `RawResult` is the last attempt's outcome (status, reads,
    first byte, done), except `t_sent_ns`, which stays the first attempt's, so TTFT and E2E
    include the retries' waits as the user saw them; the request is recorded once.
    `attempts[request_id]` lists every attempt of each request sent more than once (an absent id
    was sent once), linking each retry to its original request.
    """

    def __init__(
        self,
        inner: Transport,
        policy: RetryPolicy,
        *,
        retry_after: RetryAfterLog | None = None,
    ) -> None:
        super().__init__(inner)
        self.policy, self.retry_after = policy, retry_after
        self.attempts: dict[str, list[AttemptRecord]] = {}

    async def handle_request(self, payload: RequestPayload, result: RawResult) -> None:
        if not self.policy.enabled:
            await self.inner.handle_request(payload, result)
            return
        history: list[AttemptRecord] = []
        try:
            for n in range(1, self.policy.max_attempts + 1):
                attempt = RawResult(payload.request_id, payload.is_warmup, result.t_scheduled_ns)
                try:
                    await self.inner.handle_request(payload, attempt)
                finally:
                    self._adopt(result, attempt)
                    history.append(self._record(n, attempt, payload.request_id))
                if attempt.http_status not in self.policy.statuses or n == self.policy.max_attempts:
                    return
                wait_s = self.policy.wait_s(n, history[-1].retry_after_s)
                history[-1] = replace(history[-1], wait_s=wait_s)
                try:
                    await asyncio.sleep(wait_s)
                except asyncio.CancelledError:
                    result.status, result.error_class = RequestStatus.CANCELLED, None
                    result.error_message = "the run stopped while the request waited to retry"
                    result.t_done_ns = time.perf_counter_ns()
                    raise
        finally:
            if len(history) > 1:
                self.attempts[payload.request_id] = history

    def _record(self, n: int, attempt: RawResult, request_id: str) -> AttemptRecord:
        retry_after_s = self.retry_after.take(request_id) if self.retry_after else None
        return AttemptRecord(
            n,
            attempt.t_sent_ns,
            attempt.t_done_ns,
            attempt.http_status,
            attempt.status,
            attempt.error_class,
            retry_after_s,
        )

    @staticmethod
    def _adopt(result: RawResult, attempt: RawResult) -> None:
        """Make `result` the attempt's outcome, keeping the first attempt's send time."""
        first_sent_ns = result.t_sent_ns
        for f in fields(RawResult):
            setattr(result, f.name, getattr(attempt, f.name))
        if first_sent_ns is not None:
            result.t_sent_ns = first_sent_ns
