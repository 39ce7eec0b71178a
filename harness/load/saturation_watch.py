"""`bench run --stop-on-saturation`: the over-saturation rule of `slo.saturation`, applied while
the run goes on, so a run whose target cannot keep up stops instead of measuring a queue that
only grows (as GuideLLM's over-saturation constraint stops a benchmark).

A load observer: at each send it notes how many other measured requests are in flight (exact,
where the recorded run can only infer it afterwards); at each completion, the time to the
first byte of the answer stands in for TTFT (the tokens are parsed later, off the hot path).
Every `CHECK_EVERY` completions, from `MIN_LIVE_REQUESTS` on (twice the recorded rule's
minimum, so a start-up transient is not judged alone), the rule is judged on the completed
requests in send order; the first verdict of over-saturation calls `stop(sentence)` once.
"""

from __future__ import annotations

from collections.abc import Callable

from harness.http.client import RawResult
from slo.runrecord import RequestStatus, Saturation
from slo.saturation import MIN_REQUESTS, judge_saturation

CHECK_EVERY = 10
MIN_LIVE_REQUESTS = 2 * MIN_REQUESTS


class SaturationWatch:
    def __init__(self, stop: Callable[[str], None], *, check_every: int = CHECK_EVERY) -> None:
        self.stop = stop
        self.check_every = check_every
        self.in_flight = 0
        self.fired: str | None = None
        self._at_send: dict[str, int] = {}
        self._done: list[tuple[int, float, int]] = []  # (t_sent_ns, ttft_ms or nan, in flight)

    def on_sent(self, raw: RawResult) -> None:
        if raw.is_warmup:
            return
        self._at_send[raw.request_id] = self.in_flight
        self.in_flight += 1

    def on_done(self, raw: RawResult) -> None:
        at_send = self._at_send.pop(raw.request_id, None)
        if raw.is_warmup or at_send is None:
            return
        self.in_flight -= 1
        ok = raw.status in (None, RequestStatus.OK) and raw.http_status == 200
        first = raw.t_first_byte_ns
        ttft = (first - raw.t_sent_ns) / 1e6 if ok and first is not None else float("nan")
        self._done.append((raw.t_sent_ns or 0, ttft, at_send))
        n = len(self._done)
        if self.fired is None and n >= MIN_LIVE_REQUESTS and n % self.check_every == 0:
            self._judge()

    def _judge(self) -> None:
        rows = sorted(self._done)
        verdict = Saturation.from_dict(judge_saturation([r[1] for r in rows], [r[2] for r in rows]))
        if verdict.saturated:
            self.fired = (
                f"{verdict.sentence.rstrip('.')}; stopped by --stop-on-saturation after "
                f"{len(rows)} completed requests (time to first byte standing in for TTFT)."
            )
            self.stop(self.fired)


class Observers:
    """Several load observers as one (the progress display and the saturation watch)."""

    def __init__(self, *observers) -> None:
        self.observers = [o for o in observers if o is not None]

    def on_sent(self, raw: RawResult) -> None:
        for observer in self.observers:
            observer.on_sent(raw)

    def on_done(self, raw: RawResult) -> None:
        for observer in self.observers:
            observer.on_done(raw)
