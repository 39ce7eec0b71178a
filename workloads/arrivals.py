"""Arrival processes: when each request is sent, as offsets in seconds from the run start.

Rate-driven processes are renewal processes started at t = 0: the first request arrives after
one gap, as in vLLM's `vllm bench serve`. Gamma gaps have shape `burstiness` and scale
1 / (rate * burstiness), so the mean rate is `rate` whatever the shape and the coefficient of
variation of the gaps is 1 / sqrt(burstiness) (1 = Poisson). With `normalize_total` (vLLM's
behaviour, on by default) a fixed-count schedule is rescaled so the last request arrives at
exactly n / rate, removing seed-to-seed drift of the total duration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workloads.schema import WorkloadError


def _check_rate(rate: float, what: str = "rate") -> None:
    if not (rate > 0 and math.isfinite(rate)):
        raise WorkloadError(f"An arrival {what} must be a positive finite number, got {rate!r}.")


def _gamma_gaps(n: int, rate: float, shape: float, rng: np.random.Generator) -> np.ndarray:
    if math.isinf(shape):
        return np.full(n, 1.0 / rate)
    return rng.gamma(shape, 1.0 / (rate * shape), size=n)


def _renewal_until(
    duration_s: float, rate: float, shape: float, rng: np.random.Generator, limit: int | None
) -> np.ndarray:
    """Arrival times of a gamma renewal process in (0, duration_s], at most `limit` of them."""
    if math.isinf(shape):  # exact multiples of the gap, no accumulated rounding
        count = math.floor(duration_s * rate * (1 + 1e-12))
        count = count if limit is None else min(count, limit)
        return np.arange(1, count + 1) / rate
    chunks: list[np.ndarray] = []
    t = 0.0
    count = 0
    block = max(16, int(rate * duration_s * 1.2) + 16)
    while t <= duration_s and (limit is None or count < limit):
        times = t + np.cumsum(_gamma_gaps(block, rate, shape, rng))
        chunks.append(times)
        count += block
        t = float(times[-1])
    times = np.concatenate(chunks) if chunks else np.empty(0)
    times = times[times <= duration_s]
    return times if limit is None else times[:limit]


@dataclass(frozen=True)
class ArrivalProcess:
    """Base class; `times(n, duration_s, rng)` returns sorted float64 seconds or None (closed loop)."""

    def times(
        self, n: int | None, duration_s: float | None, rng: np.random.Generator
    ) -> np.ndarray | None:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class GammaProcess(ArrivalProcess):
    """Gamma renewal process; `burstiness` 1 is Poisson, `inf` is constant spacing."""

    rate: float
    burstiness: float = 1.0
    normalize_total: bool = True

    def __post_init__(self) -> None:
        _check_rate(self.rate)
        if not self.burstiness > 0:
            raise WorkloadError(f"burstiness must be positive, got {self.burstiness!r}.")

    def times(self, n, duration_s, rng):
        if duration_s is not None:
            return _renewal_until(duration_s, self.rate, self.burstiness, rng, n)
        if n is None:
            raise WorkloadError("An open-loop workload needs num_requests or duration_s.")
        if math.isinf(self.burstiness):
            return np.arange(1, n + 1) / self.rate
        times = np.cumsum(_gamma_gaps(n, self.rate, self.burstiness, rng))
        if self.normalize_total and n > 0 and times[-1] > 0:
            times = times * ((n / self.rate) / times[-1])
        return times

    def describe(self) -> dict[str, Any]:
        if math.isinf(self.burstiness):
            kind = "constant"
        else:
            kind = "poisson" if self.burstiness == 1.0 else "gamma"
        out: dict[str, Any] = {"process": kind, "rate": self.rate}
        if kind == "gamma":
            out["burstiness"] = self.burstiness
        out["normalize_total"] = self.normalize_total
        return out


@dataclass(frozen=True)
class AllAtOnce(ArrivalProcess):
    """Every request at t = 0."""

    def times(self, n, duration_s, rng):
        if n is None:
            raise WorkloadError(
                "An all-at-once workload needs num_requests (duration_s is not enough)."
            )
        return np.zeros(n)

    def describe(self) -> dict[str, Any]:
        return {"process": "all_at_once"}


@dataclass(frozen=True)
class LinearRamp(ArrivalProcess):
    """Poisson (or constant) arrivals whose rate rises linearly from `start_rate` to `end_rate`
    over `ramp_s` seconds, then stays at `end_rate`.

    Built by time-rescaling a unit-rate process through the cumulative intensity
    L(t) = start*t + (end - start) * t^2 / (2 * ramp_s) for t <= ramp_s.
    """

    start_rate: float
    end_rate: float
    ramp_s: float
    constant: bool = False

    def __post_init__(self) -> None:
        _check_rate(self.start_rate, "start_rate")
        _check_rate(self.end_rate, "end_rate")
        if not (self.ramp_s > 0 and math.isfinite(self.ramp_s)):
            raise WorkloadError(f"A ramp needs a positive ramp_s, got {self.ramp_s!r}.")

    def _inverse_intensity(self, lam: np.ndarray) -> np.ndarray:
        a, b, d = self.start_rate, self.end_rate, self.ramp_s
        lam_ramp = (a + b) * d / 2.0  # intensity accumulated over the ramp
        out = np.empty_like(lam)
        inside = lam <= lam_ramp
        slope = (b - a) / d
        if abs(slope) < 1e-12:
            out[inside] = lam[inside] / a
        else:
            # solve slope/2 t^2 + a t - lam = 0 for t >= 0
            out[inside] = (-a + np.sqrt(a * a + 2.0 * slope * lam[inside])) / slope
        out[~inside] = d + (lam[~inside] - lam_ramp) / b
        return out

    def times(self, n, duration_s, rng):
        if n is None and duration_s is None:
            raise WorkloadError("A ramp workload needs num_requests or duration_s.")
        shape = math.inf if self.constant else 1.0
        if duration_s is not None:
            lam_end = float(self._intensity(duration_s))
            unit = _renewal_until(lam_end, 1.0, shape, rng, n)
        else:
            unit = np.cumsum(_gamma_gaps(n, 1.0, shape, rng))
        return self._inverse_intensity(unit)

    def _intensity(self, t: float) -> float:
        a, b, d = self.start_rate, self.end_rate, self.ramp_s
        if t <= d:
            return a * t + (b - a) * t * t / (2.0 * d)
        return (a + b) * d / 2.0 + b * (t - d)

    def describe(self) -> dict[str, Any]:
        return {
            "process": "ramp",
            "start_rate": self.start_rate,
            "end_rate": self.end_rate,
            "ramp_s": self.ramp_s,
            "constant": self.constant,
        }


@dataclass(frozen=True)
class Stage:
    duration_s: float
    rate: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        _check_rate(self.rate)
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise WorkloadError(f"A stage needs a positive duration_s, got {self.duration_s!r}.")
        if not self.burstiness > 0:
            raise WorkloadError(f"A stage burstiness must be positive, got {self.burstiness!r}.")


@dataclass(frozen=True)
class Stages(ArrivalProcess):
    """Piecewise stages, each a gamma renewal process (`burstiness` 1 = Poisson, inf = constant)
    for `duration_s` seconds; the schedule ends with the last stage (or at n requests)."""

    stages: tuple[Stage, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.stages:
            raise WorkloadError("A staged arrival process needs at least one stage.")

    def times(self, n, duration_s, rng):
        parts: list[np.ndarray] = []
        start = 0.0
        for stage in self.stages:
            parts.append(
                start + _renewal_until(stage.duration_s, stage.rate, stage.burstiness, rng, None)
            )
            start += stage.duration_s
        times = np.concatenate(parts)
        if duration_s is not None:
            times = times[times <= duration_s]
        return times if n is None else times[:n]

    def describe(self) -> dict[str, Any]:
        return {
            "process": "stages",
            "stages": [
                {"duration_s": s.duration_s, "rate": s.rate, "burstiness": s.burstiness}
                for s in self.stages
            ],
        }


@dataclass(frozen=True)
class TraceTimes(ArrivalProcess):
    """Recorded timestamps (seconds), shifted to start at 0, divided by `speedup`, plus optional
    Gaussian jitter with standard deviation `jitter_s` (clipped at 0). The builder re-sorts
    requests by the jittered times, keeping each request's lengths."""

    timestamps_s: tuple[float, ...] = ()
    speedup: float = 1.0
    jitter_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        _check_rate(self.speedup, "speedup")
        if self.jitter_s < 0:
            raise WorkloadError(f"jitter_s must be >= 0, got {self.jitter_s!r}.")

    def times(self, n, duration_s, rng):
        ts = np.asarray(self.timestamps_s, dtype=np.float64)
        if ts.size == 0:
            return ts
        times = (ts - ts.min()) / self.speedup
        if self.jitter_s > 0:
            times = np.maximum(times + rng.normal(0.0, self.jitter_s, size=times.size), 0.0)
        if duration_s is not None:
            times = times[times <= duration_s]
        return times if n is None else times[:n]

    def describe(self) -> dict[str, Any]:
        return {
            "process": "trace",
            "source": self.source,
            "speedup": self.speedup,
            "jitter_s": self.jitter_s,
        }


@dataclass(frozen=True)
class ClosedLoop(ArrivalProcess):
    """No arrival times: the harness keeps `concurrency` requests in flight."""

    concurrency: int = 1

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise WorkloadError(f"concurrency must be at least 1, got {self.concurrency!r}.")

    def times(self, n, duration_s, rng):
        return None

    def describe(self) -> dict[str, Any]:
        return {"process": "closed_loop", "concurrency": self.concurrency}


_KNOWN = ("poisson", "gamma", "constant", "all_at_once", "ramp", "stages", "trace", "closed_loop")


def arrivals_from_spec(spec: dict[str, Any], *, where: str = "arrivals") -> ArrivalProcess:
    """Build a process from a YAML mapping with `process` (trace specs are built by the builder,
    which owns the loaded timestamps)."""
    if not isinstance(spec, dict) or "process" not in spec:
        raise WorkloadError(f"{where} must be a mapping with 'process' ({', '.join(_KNOWN)}).")
    s = dict(spec)
    kind = s.pop("process")
    try:
        if kind in ("poisson", "gamma", "constant"):
            burst = {"poisson": 1.0, "constant": math.inf}.get(kind)
            if burst is None:
                burst = float(s.pop("burstiness"))
            proc: ArrivalProcess = GammaProcess(
                rate=float(s.pop("rate")),
                burstiness=burst,
                normalize_total=bool(s.pop("normalize_total", True)),
            )
        elif kind == "all_at_once":
            proc = AllAtOnce()
        elif kind == "ramp":
            proc = LinearRamp(
                start_rate=float(s.pop("start_rate")),
                end_rate=float(s.pop("end_rate")),
                ramp_s=float(s.pop("ramp_s")),
                constant=bool(s.pop("constant", False)),
            )
        elif kind == "stages":
            raw = s.pop("stages")
            if not isinstance(raw, list):
                raise WorkloadError(f"{where}: 'stages' must be a list of mappings.")
            stages = []
            for i, st in enumerate(raw):
                if not isinstance(st, dict) or set(st) - {"duration_s", "rate", "burstiness"}:
                    raise WorkloadError(
                        f"{where}: stage {i} must be a mapping of duration_s, rate and burstiness."
                    )
                stages.append(
                    Stage(
                        float(st["duration_s"]), float(st["rate"]), float(st.get("burstiness", 1.0))
                    )
                )
            proc = Stages(stages=tuple(stages))
        elif kind == "closed_loop":
            proc = ClosedLoop(concurrency=int(s.pop("concurrency")))
        elif kind == "trace":
            raise WorkloadError(
                f"{where}: 'trace' arrivals need a trace source (see the spec docs)."
            )
        else:
            raise WorkloadError(f"{where}: unknown process {kind!r}; known: {', '.join(_KNOWN)}.")
    except KeyError as exc:
        raise WorkloadError(f"{where}: process {kind!r} needs the field {exc.args[0]!r}.") from None
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"{where}: bad value for process {kind!r} ({exc}).") from None
    if s:
        raise WorkloadError(
            f"{where}: unknown field(s) {', '.join(sorted(s))} for process {kind!r}."
        )
    return proc
