"""Capacity search: the highest request rate whose SLO attainment still meets a target.

Pure algorithm over a `probe(rate_per_s) -> ProbeResult` callable (the harness wires a
real benchmark run); no I/O. Steps:

1. Exponential ramp from `start_rate`: multiply by `growth` while the target is met (or
   divide while it is not) until a passing and a failing rate bracket the knee.
2. Bisection until (high - low) / low <= `rel_width` (2.5% by default).
3. Re-check both bracket ends (attainment is noisy and not strictly monotone in rate).
   A rate's verdict is the majority of its probes' verdicts; a tie is broken by probing
   once more. If the low end now fails or the high end now passes, the bracket moves to
   the nearest rates with the right verdict (ramping further when none is known) and
   bisection resumes.
4. One final confirming run at the low end; `confirmed` says whether it met the target.

`max_iterations` bounds the number of probe calls in all steps together; one call is
kept back for the confirming run. Every probe is returned in `curve`, so the caller can
save goodput versus rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from slo.errors import SLOError


class CapacitySearchError(SLOError, ValueError):
    """Bad search parameters or a probe result that cannot be used (one sentence)."""


@dataclass(frozen=True)
class ProbeResult:
    """One benchmark run at `rate_per_s`: attainment in [0, 1], goodput in requests/s."""

    rate_per_s: float
    attainment: float
    goodput_per_s: float | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.attainment, int | float) and 0 <= self.attainment <= 1):
            raise CapacitySearchError(f"attainment must be in [0, 1], not {self.attainment!r}.")


@dataclass(frozen=True)
class CapacityResult:
    """Outcome of `search`.

    `capacity_rate_per_s`: the highest rate judged to meet the target (None when even the
    lowest rate tried failed). `bracket`: (passing rate, failing rate), either may be None.
    `converged`: the bracket reached `rel_width`. `confirmed`: the final confirming run met
    the target. `curve`: every probe in call order. `stop_reason`: why the search ended.
    """

    capacity_rate_per_s: float | None
    bracket: tuple[float | None, float | None]
    target: float
    converged: bool
    confirmed: bool
    iterations: int
    stop_reason: str
    curve: tuple[ProbeResult, ...]

    def curve_points(self) -> list[dict]:
        """Goodput and attainment versus rate: one row per distinct rate, sorted by rate,
        with the mean over that rate's probes (`n_probes` says how many) and
        `meets_target`, the majority verdict (None on a tie)."""
        by_rate: dict[float, list[ProbeResult]] = {}
        for p in self.curve:
            by_rate.setdefault(p.rate_per_s, []).append(p)
        rows = []
        for rate in sorted(by_rate):
            probes = by_rate[rate]
            goodputs = [p.goodput_per_s for p in probes if p.goodput_per_s is not None]
            rows.append({
                "rate_per_s": rate,
                "n_probes": len(probes),
                "attainment": sum(p.attainment for p in probes) / len(probes),
                "goodput_per_s": sum(goodputs) / len(goodputs) if goodputs else None,
                "meets_target": _majority([p.attainment >= self.target for p in probes]),
            })  # fmt: skip
        return rows

    def to_dict(self) -> dict:
        """JSON-serialisable form, with `curve` as per-probe rows and `curve_points`."""
        return {
            "capacity_rate_per_s": self.capacity_rate_per_s,
            "bracket": list(self.bracket),
            "target": self.target,
            "converged": self.converged,
            "confirmed": self.confirmed,
            "iterations": self.iterations,
            "stop_reason": self.stop_reason,
            "curve": [asdict(p) for p in self.curve],
            "curve_points": self.curve_points(),
        }


class _BudgetSpent(Exception):
    pass


def _majority(votes: list[bool]) -> bool | None:
    passing = sum(votes)
    failing = len(votes) - passing
    return None if passing == failing else passing > failing


class _Search:
    def __init__(self, probe, target, max_iterations, min_rate, max_rate):
        self.probe = probe
        self.target = target
        self.max_iterations = max_iterations
        self.min_rate = min_rate
        self.max_rate = max_rate
        self.curve: list[ProbeResult] = []
        self.history: dict[float, list[float]] = {}
        self.low: float | None = None
        self.high: float | None = None

    @property
    def left(self) -> int:
        return self.max_iterations - len(self.curve)

    def run(self, rate: float, *, reserve: int = 1) -> bool:
        if self.left <= reserve:
            raise _BudgetSpent
        result = self._probe(rate)
        self.curve.append(result)
        self.history.setdefault(rate, []).append(result.attainment)
        while (verdict := self.verdict(rate)) is None:
            if self.left <= reserve:
                raise _BudgetSpent
            self.curve.append(self._probe(rate))
            self.history[rate].append(self.curve[-1].attainment)
        return verdict

    def _probe(self, rate: float) -> ProbeResult:
        result = self.probe(rate)
        if not isinstance(result, ProbeResult):
            raise CapacitySearchError(
                f"probe must return a ProbeResult, not {type(result).__name__}."
            )
        if math.isclose(result.rate_per_s, rate, rel_tol=1e-9):
            return result
        # keyed by the requested rate; keep what the probe reported (e.g. achieved rate)
        extra = {"reported_rate_per_s": result.rate_per_s, **result.extra}
        return ProbeResult(rate, result.attainment, result.goodput_per_s, extra)

    def verdict(self, rate: float) -> bool | None:
        return _majority([a >= self.target for a in self.history[rate]])

    def passes(self, rate: float) -> bool:
        return self.verdict(rate) is True

    def known(self, passing: bool) -> list[float]:
        return sorted(r for r in self.history if self.verdict(r) is passing)


def _check(target, start_rate, max_iterations, rel_width, growth, min_rate, max_rate) -> None:
    if not 0 < target <= 1:
        raise CapacitySearchError("target attainment must be in (0, 1].")
    if not start_rate > 0 or not math.isfinite(start_rate):
        raise CapacitySearchError("start_rate must be a positive, finite rate.")
    if max_iterations < 2:
        raise CapacitySearchError(
            "max_iterations must be at least 2 (one probe and the confirming run)."
        )
    if not 0 < rel_width < 1:
        raise CapacitySearchError("rel_width must be in (0, 1).")
    if not growth > 1:
        raise CapacitySearchError("growth must be > 1.")
    if min_rate is not None and max_rate is not None and not min_rate < max_rate:
        raise CapacitySearchError("min_rate must be below max_rate.")
    if (min_rate is not None and start_rate < min_rate) or (
        max_rate is not None and start_rate > max_rate
    ):
        raise CapacitySearchError("start_rate must lie between min_rate and max_rate.")


def search(
    probe: Callable[[float], ProbeResult],
    *,
    target: float,
    start_rate: float,
    max_iterations: int = 24,
    rel_width: float = 0.025,
    growth: float = 2.0,
    min_rate: float | None = None,
    max_rate: float | None = None,
) -> CapacityResult:
    """Find the highest rate (requests/s) at which `probe` reports attainment >= `target`.

    `min_rate`/`max_rate` bound the ramp (None: unbounded below down to start_rate /
    growth**30, unbounded above). See the module docstring for the steps.
    """
    _check(target, start_rate, max_iterations, rel_width, growth, min_rate, max_rate)
    s = _Search(probe, target, max_iterations, min_rate, max_rate)
    floor = min_rate if min_rate is not None else start_rate / growth**30
    # s.low: highest rate judged passing, s.high: lowest judged failing, of the current
    # bracket; updated after every probe so that running out of budget keeps the best so far
    stop_reason = "converged"

    def ramp_up() -> None:
        while True:
            nxt = s.low * growth if max_rate is None else min(s.low * growth, max_rate)
            if nxt <= s.low:
                return
            if not s.run(nxt):
                s.high = nxt
                return
            s.low = nxt

    def ramp_down() -> None:
        while True:
            nxt = max(s.high / growth, floor)
            if nxt >= s.high:
                return
            if s.run(nxt):
                s.low = nxt
                return
            s.high = nxt

    try:
        if s.run(start_rate):
            s.low = start_rate
            ramp_up()
        else:
            s.high = start_rate
            ramp_down()
        while s.low is not None and s.high is not None:
            while (s.high - s.low) / s.low > rel_width:
                mid = (s.low + s.high) / 2
                if s.run(mid):
                    s.low = mid
                else:
                    s.high = mid
            # re-check the bracket ends; keep one call for the confirming run
            if s.left < 3:
                stop_reason = "budget spent before re-checking the bracket"
                break
            s.run(s.low, reserve=2)
            s.run(s.high)
            if s.passes(s.low) and not s.passes(s.high):
                break
            if not s.passes(s.low):
                s.high = s.low
                below = [r for r in s.known(True) if r < s.high]
                s.low = below[-1] if below else None
                if s.low is None:
                    ramp_down()
            else:
                s.low = s.high
                above = [r for r in s.known(False) if r > s.low]
                s.high = above[0] if above else None
                if s.high is None:
                    ramp_up()
        if s.low is not None and s.high is None:
            stop_reason = "target still met at max_rate"
        elif s.low is None:
            stop_reason = "target not met even at the lowest rate tried"
    except _BudgetSpent:
        stop_reason = "max_iterations reached"
    low, high = s.low, s.high

    converged = (
        stop_reason == "converged" and low is not None and high is not None
        and (high - low) / low <= rel_width
    )  # fmt: skip
    confirmed = False
    if low is not None and s.left >= 1:
        s.curve.append(s._probe(low))
        confirmed = s.curve[-1].attainment >= target
    return CapacityResult(
        capacity_rate_per_s=low,
        bracket=(low, high),
        target=target,
        converged=converged,
        confirmed=bool(confirmed),
        iterations=len(s.curve),
        stop_reason=stop_reason,
        curve=tuple(s.curve),
    )
