"""The probe's background streams: the reference request streamed, over and over while the cases
run, each answer checked to end with the reference text, and the failures tied to the cases that
ran while they were in flight."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from faults.probe_cases.case import COMPLETIONS
from faults.probe_report import StreamFailure, StreamsResult
from faults.raw_http import HttpAnswer, Outcome, RawServer, no_answer_reason
from harness.http.sse import parse_stream

_MAX_STREAM_FAILURES_KEPT = 20


@dataclass
class StreamTally:
    num_completed: int = 0
    failures: list[tuple[int, int, str]] = field(default_factory=list)  # (start_ns, end_ns, why)
    max_latency_ms: float | None = None


async def stream_until(
    server: RawServer,
    body: bytes,
    stop: asyncio.Event,
    *,
    reference_text: str,
    timeout_s: float,
) -> StreamTally:
    """Streamed reference requests (`body`), one after another, until `stop` (at least one)."""
    tally = StreamTally()
    while True:
        start_ns = time.monotonic_ns()
        answer = await server.send("POST", COMPLETIONS, timeout_s=timeout_s, body=body)
        problem = _stream_problem(answer, reference_text, timeout_s)
        if problem is None:
            tally.num_completed += 1
            tally.max_latency_ms = max(tally.max_latency_ms or 0.0, answer.elapsed_ms)
        else:
            tally.failures.append((start_ns, time.monotonic_ns(), problem))
            await asyncio.sleep(0.05)  # a server that is down refuses at once; do not spin
        if stop.is_set():
            return tally


def _stream_problem(answer: HttpAnswer, reference_text: str, timeout_s: float) -> str | None:
    if answer.outcome is not Outcome.ANSWERED:
        return no_answer_reason("a background stream", answer, timeout_s)
    if answer.status != 200:
        return f"a background stream answered {answer.status}"
    parsed = parse_stream([(0, answer.body)], chat=False)
    if parsed.error_message is not None:
        return f"a background stream broke: {parsed.error_message}"
    if parsed.text != reference_text:
        return f"a background stream said {parsed.text!r} instead of {reference_text!r}"
    return None


def streams_result(
    num_streams: int, tallies: list[StreamTally], spans: list[tuple[int, int, str]]
) -> StreamsResult:
    """The streams' tally; each kept failure names the cases whose (start_ns, end_ns, name)
    span overlapped it."""
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
