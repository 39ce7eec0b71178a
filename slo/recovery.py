"""Recovery figures for fault windows: how goodput behaved before, during and after each fault.

A window is `{kind, start_s, end_s}` (seconds from t0, as the run's manifest records the faults
it applied). Goodput is good requests per second by completion time, where good is `ok` and, with
an SLO, meeting every per-request objective. For each window:
- `goodput_before_per_s`: over `[start - L, start)`, L = the window's length (at most the time
  before it, at least 1 s when there is that much run before it);
- `recovery_s`: from `end_s` to the start of the first bin (width `bin_s`) whose goodput is at
  least `RECOVERED` (90%) of the level before; 0 when the first bin after the fault is already
  there; None otherwise, and `recovery` says why (a `Recovery` value):
  `recovered` (recovery_s is set); `never` (goodput did not get back in the whole bins between
  the window's end and the run's end); `run_ended_in_window` (the window has no end, or the
  run ended inside it or less than one bin after it: no time after the fault to judge);
  `no_level_before` (no good request finished before the window: nothing to get back to).
- `attainment_in_window`: good / sent among requests sent inside the window (None if none);
- `outcomes_in_window`: requests sent inside the window by status and error class.
"""

from __future__ import annotations

import math
from collections import Counter
from enum import StrEnum

import numpy as np

from slo.frame import RequestMetrics
from slo.goodput import good_mask
from slo.spec import SLOSpec

RECOVERED = 0.9


class Recovery(StrEnum):
    """How a fault window's recovery was judged (the module docstring says when)."""

    RECOVERED = "recovered"
    NEVER = "never"
    RUN_ENDED_IN_WINDOW = "run_ended_in_window"
    NO_LEVEL_BEFORE = "no_level_before"


def _rate(done_s: np.ndarray, good: np.ndarray, lo: float, hi: float) -> float | None:
    if hi <= lo:
        return None
    inside = good & (done_s >= lo) & (done_s < hi)
    return float(inside.sum()) / (hi - lo)


def recovery_for_window(
    rm: RequestMetrics,
    window: dict,
    *,
    spec: SLOSpec | None = None,
    bin_s: float = 1.0,
) -> dict:
    """The recovery figures of one window (see the module docstring)."""
    start, end = float(window["start_s"]), float(window.get("end_s") or math.nan)
    good = good_mask(rm, spec) if spec is not None else rm.is_ok
    done_s = rm.t_done_ns / 1e9
    sent_s = rm.t_sent_ns / 1e9
    length = (end - start) if math.isfinite(end) else bin_s
    lookback = min(max(length, 1.0), start)
    before = _rate(done_s, good, start - lookback, start) if lookback > 0 else None
    run_end = float(np.nanmax(done_s)) if np.any(~np.isnan(done_s)) else end
    recovery = None
    if not math.isfinite(end) or end + bin_s > run_end + 1e-9:
        judged = Recovery.RUN_ENDED_IN_WINDOW
    elif not before:
        judged = Recovery.NO_LEVEL_BEFORE
    else:
        judged = Recovery.NEVER
        t = end
        while t + bin_s <= run_end + 1e-9:
            level = _rate(done_s, good, t, t + bin_s)
            if level is not None and level >= RECOVERED * before:
                recovery, judged = t - end, Recovery.RECOVERED
                break
            t += bin_s / 4  # slide in quarter bins: the figure is accurate to bin_s / 4
    in_window = (sent_s >= start) & (sent_s < (end if math.isfinite(end) else np.inf))
    outcomes = Counter(
        f"{s}/{c}" if c else str(s)
        for s, c in zip(rm.status[in_window], rm.error_class[in_window], strict=True)
    )
    n = int(in_window.sum())
    return {
        "kind": window.get("kind"),
        "start_s": start,
        "end_s": end if math.isfinite(end) else None,
        "goodput_before_per_s": before,
        "goodput_during_per_s": _rate(done_s, good, start, end) if math.isfinite(end) else None,
        "recovery_s": recovery,
        "recovery": judged.value,
        "recovery_bin_s": bin_s,
        "attainment_in_window": (float(good[in_window].sum()) / n) if n else None,
        "requests_in_window": n,
        "outcomes_in_window": dict(sorted(outcomes.items())),
    }


def recovery_summary(rm: RequestMetrics, windows: list[dict], *, spec: SLOSpec | None) -> list:
    """One entry per applied fault window, in order."""
    return [recovery_for_window(rm, w, spec=spec) for w in windows if w.get("start_s") is not None]
