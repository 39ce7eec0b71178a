"""Token-length distributions: fixed, uniform, normal, lognormal, empirical and file-backed.

Every distribution samples integer token counts with a passed-in `numpy.random.Generator` and
clips them to [`min`, `max`] (`min` defaults to 1). Specs are dicts such as
`{dist: lognormal, median: 200, sigma: 0.9, max: 1024}`; `length_from_spec` builds one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workloads.schema import WorkloadError


@dataclass(frozen=True)
class LengthDist:
    """Base: subclasses implement `_draw` (floats or ints); `sample` rounds and clips."""

    min: int = 1
    max: int | None = None

    def __post_init__(self) -> None:
        if self.min < 1:
            raise WorkloadError(f"A length minimum must be at least 1, got {self.min}.")
        if self.max is not None and self.max < self.min:
            raise WorkloadError(f"A length maximum ({self.max}) is below its minimum ({self.min}).")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """`n` token counts (int64), each in [min, max]."""
        values = np.rint(np.asarray(self._draw(n, rng), dtype=np.float64))
        upper = np.inf if self.max is None else self.max
        return np.clip(values, self.min, upper).astype(np.int64)

    def _draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def _bounds(self) -> dict[str, Any]:
        return {"min": self.min, "max": self.max}


@dataclass(frozen=True)
class Fixed(LengthDist):
    value: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.value < 1:
            raise WorkloadError(f"A fixed length must be at least 1, got {self.value}.")

    def _draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.value, dtype=np.float64)

    def describe(self) -> dict[str, Any]:
        return {"dist": "fixed", "value": self.value} | self._bounds()


@dataclass(frozen=True)
class Uniform(LengthDist):
    """Uniform integers in [low, high] inclusive (vLLM's random dataset: see `uniform_bounds`)."""

    low: int = 1
    high: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.low <= self.high:
            raise WorkloadError(
                f"Uniform lengths need 1 <= low <= high, got [{self.low}, {self.high}]."
            )

    def _draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n).astype(np.float64)

    def describe(self) -> dict[str, Any]:
        return {"dist": "uniform", "low": self.low, "high": self.high} | self._bounds()


def uniform_bounds(value: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's `--random-range-ratio` bounds: [floor(L*(1-r)), ceil(L*(1+r))], r in [0, 1), the
    lower bound raised to 1 (vLLM raises it to 1 for output lengths; a prompt needs 1 too)."""
    if not 0.0 <= range_ratio < 1.0:
        raise WorkloadError(f"range_ratio must be in [0, 1), got {range_ratio}.")
    low = max(math.floor(value * (1.0 - range_ratio)), 1)
    high = max(math.ceil(value * (1.0 + range_ratio)), 1)
    return low, high


@dataclass(frozen=True)
class Normal(LengthDist):
    """Normal(mean, std) rounded and clipped to [min, max]."""

    mean: float = 1.0
    std: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.std < 0:
            raise WorkloadError(f"A normal length needs std >= 0, got {self.std}.")

    def _draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.normal(self.mean, self.std, size=n)

    def describe(self) -> dict[str, Any]:
        return {"dist": "normal", "mean": self.mean, "std": self.std} | self._bounds()


@dataclass(frozen=True)
class LogNormal(LengthDist):
    """exp(Normal(mu, sigma)); the median is exp(mu)."""

    mu: float = 0.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sigma < 0:
            raise WorkloadError(f"A lognormal length needs sigma >= 0, got {self.sigma}.")

    def _draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.lognormal(self.mu, self.sigma, size=n)

    def describe(self) -> dict[str, Any]:
        return {"dist": "lognormal", "mu": self.mu, "sigma": self.sigma} | self._bounds()


@dataclass(frozen=True)
class Empirical(LengthDist):
    """Inverse-CDF sampling from quantile points `(probability, value)`, linear in between.

    Probabilities must rise from 0 to 1 and values must not fall. A histogram
    (`edges`, `counts`) is turned into such points by `from_histogram`.
    """

    probs: tuple[float, ...] = (0.0, 1.0)
    values: tuple[float, ...] = (1.0, 1.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        p = np.asarray(self.probs, dtype=np.float64)
        v = np.asarray(self.values, dtype=np.float64)
        if len(p) < 2 or len(p) != len(v):
            raise WorkloadError("Empirical quantiles need at least two (probability, value) pairs.")
        if not (np.isclose(p[0], 0.0) and np.isclose(p[-1], 1.0)) or np.any(np.diff(p) < 0):
            raise WorkloadError("Empirical quantile probabilities must rise from 0 to 1.")
        if np.any(np.diff(v) < 0) or v[0] < 0:
            raise WorkloadError(
                "Empirical quantile values must be non-negative and non-decreasing."
            )

    @classmethod
    def from_histogram(
        cls, edges: list[float], counts: list[float], *, min: int = 1, max: int | None = None
    ) -> Empirical:
        """A distribution uniform within each bin [edges[i], edges[i+1]], bin mass ~ counts[i]."""
        if len(edges) != len(counts) + 1 or len(counts) < 1:
            raise WorkloadError("A length histogram needs len(edges) == len(counts) + 1.")
        c = np.asarray(counts, dtype=np.float64)
        if np.any(c < 0) or c.sum() <= 0:
            raise WorkloadError("Length histogram counts must be non-negative with a positive sum.")
        cdf = np.concatenate([[0.0], np.cumsum(c) / c.sum()])
        return cls(
            min=min, max=max, probs=tuple(cdf.tolist()), values=tuple(float(e) for e in edges)
        )

    def _draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.interp(rng.random(n), self.probs, self.values)

    def describe(self) -> dict[str, Any]:
        return {
            "dist": "empirical",
            "quantiles": [list(q) for q in zip(self.probs, self.values, strict=True)],
        } | self._bounds()


@dataclass(frozen=True)
class Sampled(LengthDist):
    """Resampling (with replacement) from a list of observed lengths, e.g. a file's column."""

    observed: tuple[int, ...] = (1,)
    source: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.observed:
            raise WorkloadError(f"No lengths were read from {self.source or 'the given list'}.")

    def _draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.asarray(self.observed, dtype=np.float64)[
            rng.integers(0, len(self.observed), size=n)
        ]

    def describe(self) -> dict[str, Any]:
        return {"dist": "file", "source": self.source, "count": len(self.observed)} | self._bounds()


def read_length_file(path: Path, column: str | None) -> list[int]:
    """Integers from a text file (one per line) or, with `column`, a CSV column (header row)."""
    import csv

    if not path.is_file():
        raise WorkloadError(f"Length file {path} does not exist.")
    out: list[int] = []
    with path.open(newline="", encoding="utf-8") as fh:
        if column is None:
            rows = ((i + 1, line.strip()) for i, line in enumerate(fh))
        else:
            reader = csv.DictReader(fh)
            if reader.fieldnames is None or column not in reader.fieldnames:
                raise WorkloadError(f"Length file {path} has no column {column!r}.")
            rows = ((i + 2, (row.get(column) or "").strip()) for i, row in enumerate(reader))
        for line_no, text in rows:
            if not text:
                continue
            try:
                value = int(float(text))
            except ValueError:
                raise WorkloadError(f"{path}:{line_no}: {text!r} is not a token count.") from None
            out.append(value)
    return out


_KNOWN = ("fixed", "uniform", "normal", "lognormal", "empirical", "file")


def length_from_spec(
    spec: Any, *, base_dir: Path | None = None, where: str = "length"
) -> LengthDist:
    """Build a distribution from a YAML value: an integer (fixed) or a dict with `dist`."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return Fixed(value=spec)
    if not isinstance(spec, dict) or "dist" not in spec:
        raise WorkloadError(
            f"{where} must be an integer or a mapping with 'dist' ({', '.join(_KNOWN)})."
        )
    s = dict(spec)
    kind = s.pop("dist")
    bounds = {
        "min": int(s.pop("min", 1)),
        "max": None if s.get("max") is None else int(s.pop("max")),
    }
    s.pop("max", None)
    try:
        if kind == "fixed":
            dist: LengthDist = Fixed(value=int(s.pop("value")), **bounds)
        elif kind == "uniform":
            if "value" in s:
                low, high = uniform_bounds(int(s.pop("value")), float(s.pop("range_ratio", 0.0)))
            else:
                low, high = int(s.pop("low")), int(s.pop("high"))
            dist = Uniform(low=low, high=high, **bounds)
        elif kind == "normal":
            dist = Normal(mean=float(s.pop("mean")), std=float(s.pop("std")), **bounds)
        elif kind == "lognormal":
            if "median" in s:
                mu = math.log(float(s.pop("median")))
            else:
                mu = float(s.pop("mu"))
            dist = LogNormal(mu=mu, sigma=float(s.pop("sigma")), **bounds)
        elif kind == "empirical":
            if "quantiles" in s or "bundled" in s:
                if "bundled" in s:
                    from workloads.quantiles import bundled_points

                    points = bundled_points(str(s.pop("bundled")))
                else:
                    points = s.pop("quantiles")
                if isinstance(points, dict):
                    points = sorted((float(k), float(v)) for k, v in points.items())
                probs = tuple(float(p) for p, _ in points)
                values = tuple(float(v) for _, v in points)
                dist = Empirical(probs=probs, values=values, **bounds)
            else:
                hist = s.pop("histogram")
                dist = Empirical.from_histogram(hist["edges"], hist["counts"], **bounds)
        elif kind == "file":
            path = Path(s.pop("path"))
            if base_dir is not None and not path.is_absolute():
                path = base_dir / path
            column = s.pop("column", None)
            dist = Sampled(
                observed=tuple(read_length_file(path, column)), source=str(path), **bounds
            )
        else:
            raise WorkloadError(f"{where}: unknown dist {kind!r}; known: {', '.join(_KNOWN)}.")
    except KeyError as exc:
        raise WorkloadError(f"{where}: dist {kind!r} needs the field {exc.args[0]!r}.") from None
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"{where}: bad value for dist {kind!r} ({exc}).") from None
    if s:
        raise WorkloadError(f"{where}: unknown field(s) {', '.join(sorted(s))} for dist {kind!r}.")
    return dist
