"""What a run's output cost: US dollars per million output tokens at the SLO, and joules per
output token.

Cost: the run is told what the target costs an hour (`bench run --cost-per-hour USD`, recorded
as the manifest's `config.cost_per_hour`). The run's cost is that rate times the measured
window (first send to last done). Spread over the output tokens of the requests that met the
SLO (finished ok within every per-request objective, `slo.goodput.good_mask`), it is the cost
per million good tokens: goodput-based, so failed requests and requests that missed the SLO
cost without counting. Beside it, the same cost over every sent request's output tokens (failed
requests' partial output included: the target produced them). Without an SLO there is only the
all-tokens figure; with an SLO that no request met, the good-token figure has no value (it is
infinite) and says so.

Energy: the manifest's `energy` record (`harness.run.energy`) holds the joules that this host's
counters (RAPL packages, NVML GPUs) counted over the measured phase; divided by every sent
request's output tokens it is joules per output token. The counters measure the host the
harness ran on, so a target elsewhere (any URL not on loopback) has no figure.
"""

from __future__ import annotations

import math
from urllib.parse import urlsplit

import numpy as np

from slo.frame import RequestMetrics
from slo.goodput import good_mask
from slo.runrecord.bounds_sections import Cost, Energy, EnergyRecord
from slo.spec import SLOSpec

SECONDS_PER_HOUR = 3600.0
COST_FORMULA = (
    "USD per million tokens = cost_per_hour × window_s / 3600 / (output tokens / 1e6); at the "
    "SLO: the output tokens of requests that met it; all: every sent request's output tokens"
)
NO_COST = "no --cost-per-hour was given"
NO_SLO = "no SLO was given, so there is only the cost per million of all output tokens"
NO_GOOD = (
    "no request met the SLO: the run's cost bought no good token (infinite per million good tokens)"
)
NO_OUTPUT = "the run produced no output token"
NO_WINDOW = "the run has no measured window (no request was sent and finished)"
NO_RECORD = "the run recorded no energy counters (a run directory written before them)"
LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
LOCAL_NOTE = (
    "this host's counters over the measured phase: RAPL packages count every process on its "
    "CPUs (the engine and the load generator together), NVML each GPU's whole board"
)


def output_token_sum(rm: RequestMetrics, mask: np.ndarray | None = None) -> int:
    """The output tokens of the requests of `rm` (those in `mask`), missing counts as none."""
    values = rm.output_tokens if mask is None else rm.output_tokens[mask]
    return int(np.nansum(values))


def per_million(cost_usd: float, tokens: int) -> float | None:
    """`cost_usd` per million `tokens`; None for no tokens."""
    return cost_usd / (tokens / 1e6) if tokens > 0 else None


def cost_summary(rm: RequestMetrics, spec: SLOSpec | None, cost_per_hour: float | None) -> Cost:
    """The cost block (module docstring) for the sent requests `rm` at `spec` (None: no SLO),
    at `cost_per_hour` US dollars (None: not given; absent)."""
    if cost_per_hour is None:
        return Cost(formula=COST_FORMULA, absent=NO_COST)
    if (
        isinstance(cost_per_hour, bool)
        or not isinstance(cost_per_hour, int | float)
        or not math.isfinite(cost_per_hour)
        or cost_per_hour < 0
    ):
        return Cost(
            formula=COST_FORMULA,
            absent=f"the recorded cost_per_hour ({cost_per_hour!r}) is not a dollar amount of "
            "zero or more",
        )
    window_s = rm.window_s()
    if window_s is None:
        return Cost(formula=COST_FORMULA, cost_per_hour_usd=float(cost_per_hour), absent=NO_WINDOW)
    run_cost = float(cost_per_hour) * window_s / SECONDS_PER_HOUR
    all_tokens = output_token_sum(rm)
    good_tokens = None if spec is None else output_token_sum(rm, good_mask(rm, spec))
    good_absent = NO_SLO if spec is None else (NO_GOOD if not good_tokens else None)
    return Cost(
        formula=COST_FORMULA,
        cost_per_hour_usd=float(cost_per_hour),
        window_s=window_s,
        run_cost_usd=run_cost,
        good_output_tokens=good_tokens,
        all_output_tokens=all_tokens,
        usd_per_million_good_tokens=None if good_absent else per_million(run_cost, good_tokens),
        usd_per_million_output_tokens=per_million(run_cost, all_tokens),
        good_absent=good_absent,
        all_absent=None if all_tokens else NO_OUTPUT,
    )


def target_host(target: dict | None) -> str | None:
    """The host of the manifest target's URL, lower case (None without one)."""
    url = (target or {}).get("url")
    return urlsplit(url).hostname if isinstance(url, str) and url else None


def energy_summary(record: dict | None, rm: RequestMetrics, *, target: dict | None) -> Energy:
    """The energy block (module docstring) of the manifest's `energy` record for the sent
    requests `rm`; absent when nothing was recorded or read, or the target is not on this
    host."""
    read = EnergyRecord.from_dict(record)
    if read is None:
        return Energy(absent=NO_RECORD)
    if read.unavailable:
        return Energy(absent=read.unavailable)
    host = target_host(target)
    if host is not None and host not in LOOPBACK:
        return Energy(
            absent=f"the target ({host}) is not on the harness's host, whose counters these are"
        )
    counters = [c for c in read.counters or [] if c.joules is not None]
    if not counters:
        return Energy(absent="the energy record holds no counter")
    joules = float(sum(c.joules for c in counters))
    tokens = output_token_sum(rm)
    duration_s = read.duration_s
    return Energy(
        joules=joules,
        joules_by_counter={c.name: float(c.joules) for c in counters},
        duration_s=duration_s,
        mean_power_w=joules / duration_s if duration_s else None,
        all_output_tokens=tokens,
        joules_per_output_token=joules / tokens if tokens else None,
        note=LOCAL_NOTE if tokens else f"{LOCAL_NOTE}; no output token to divide by",
    )
