"""SLO specs: a frozen dataclass read from YAML, schema-checked with one-sentence errors.

YAML fields (all optional except `name`):

    name: p99                         # str
    description: ...                  # str
    source: ...                       # str, where the limits come from
    per_request:                      # a request is good when ok and within all of these
      ttft_ms: 2000                   #   send to first token
      tpot_ms: 200                    #   time per output token after the first
      max_itl_ms: 1000                #   longest gap between token-bearing chunks (a stall)
      e2e_ms: 30000                   #   send to done
    percentiles:                      # objectives on a distribution over ok requests
      - {metric: ttft_ms, percentile: 99, max_ms: 2000}
    attainment_min: 0.99              # fraction of all requests that must be good
    error_rate_max: 0.01              # fraction of all requests that may end not ok
    min_samples: 100                  # fewer samples than this: inconclusive
    confidence: 0.95                  # bootstrap confidence interval level
    early_stopping_confidence: 0.99   # binomial (MLPerf early-stopping) confidence
    slices:                           # per-slice overrides of per_request objectives
      - name: long_prompts
        input_tokens: [2048, null]    # [low, high): null = unbounded
        output_tokens: [null, null]
        per_request: {ttft_ms: 4000}
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path

import yaml

from slo.errors import SLOError

PERCENTILE_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "max_itl_ms", "e2e_ms")
_TOP_LEVEL = (
    "name", "description", "source", "per_request", "percentiles", "attainment_min",
    "error_rate_max", "min_samples", "confidence", "early_stopping_confidence", "slices",
)  # fmt: skip


def _positive_ms(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise SLOError(f"{where} must be a positive number of milliseconds, not {value!r}.")
    if math.isinf(value):
        raise SLOError(f"{where} must be finite; leave it out for no limit.")
    return float(value)


def _fraction(value, where: str, *, allow_zero: bool) -> float:
    ok_low = value >= 0 if allow_zero else value > 0
    if isinstance(value, bool) or not isinstance(value, int | float) or not (ok_low and value <= 1):
        low = "[0, 1]" if allow_zero else "(0, 1]"
        raise SLOError(f"{where} must be a fraction in {low} (write 0.99 for 99%), not {value!r}.")
    return float(value)


def _mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise SLOError(f"{where} must be a mapping, not {type(value).__name__}.")
    return value


def _check_keys(data: dict, known: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise SLOError(
            f"{where} has unknown field {unknown[0]!r}; known fields: {', '.join(known)}."
        )


@dataclass(frozen=True)
class PerRequestObjectives:
    """Thresholds (ms) one request must meet to count as good; None = no limit."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    max_itl_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _positive_ms(getattr(self, f.name), f.name))

    @classmethod
    def from_dict(cls, data, where: str) -> PerRequestObjectives:
        data = _mapping(data, where)
        _check_keys(data, tuple(f.name for f in fields(cls)), where)
        return cls(**{k: _positive_ms(v, f"{where}.{k}") for k, v in data.items()})

    def merged(self, override: PerRequestObjectives) -> PerRequestObjectives:
        """These objectives with every limit that `override` sets replaced."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update({k: v for k, v in asdict(override).items() if v is not None})
        return PerRequestObjectives(**values)

    def active(self) -> dict[str, float]:
        """The limits that are set, by field name."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class PercentileObjective:
    """`metric`'s `percentile`-th percentile over ok requests must be <= `max_ms`."""

    metric: str
    percentile: float
    max_ms: float

    def __post_init__(self) -> None:
        if self.metric not in PERCENTILE_METRICS:
            raise SLOError(
                f"percentile metric {self.metric!r} is unknown; known: {', '.join(PERCENTILE_METRICS)}."
            )
        p = self.percentile
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p < 100:
            raise SLOError(f"percentile must be a number strictly between 0 and 100, not {p!r}.")
        object.__setattr__(self, "percentile", float(p))
        object.__setattr__(self, "max_ms", _positive_ms(self.max_ms, "max_ms"))

    @property
    def name(self) -> str:
        return f"{self.metric} p{self.percentile:g} <= {self.max_ms:g} ms"

    @classmethod
    def from_dict(cls, data, where: str) -> PercentileObjective:
        data = _mapping(data, where)
        _check_keys(data, ("metric", "percentile", "max_ms"), where)
        missing = [k for k in ("metric", "percentile", "max_ms") if k not in data]
        if missing:
            raise SLOError(f"{where} is missing {missing[0]!r}.")
        return cls(**data)


def _bounds(value, where: str) -> tuple[float | None, float | None]:
    if value is None:
        return (None, None)
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise SLOError(f"{where} must be a [low, high) pair such as [2048, null], not {value!r}.")
    low, high = value
    for v in (low, high):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v < 0):
            raise SLOError(f"{where} bounds must be non-negative numbers or null, not {v!r}.")
    if low is not None and high is not None and not low < high:
        raise SLOError(f"{where} must have low < high, not {value!r}.")
    return (None if low is None else float(low), None if high is None else float(high))


@dataclass(frozen=True)
class SliceOverride:
    """Requests whose token counts fall in [low, high) get `per_request` limits instead."""

    name: str
    per_request: PerRequestObjectives
    input_tokens: tuple[float | None, float | None] = (None, None)
    output_tokens: tuple[float | None, float | None] = (None, None)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SLOError("every slice override needs a non-empty name.")

    @classmethod
    def from_dict(cls, data, where: str) -> SliceOverride:
        data = _mapping(data, where)
        _check_keys(data, ("name", "input_tokens", "output_tokens", "per_request"), where)
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise SLOError(f"{where} needs a non-empty name.")
        return cls(
            name=name,
            per_request=PerRequestObjectives.from_dict(
                data.get("per_request", {}), f"{where}.per_request"
            ),
            input_tokens=_bounds(data.get("input_tokens"), f"{where}.input_tokens"),
            output_tokens=_bounds(data.get("output_tokens"), f"{where}.output_tokens"),
        )


@dataclass(frozen=True)
class SLOSpec:
    """A service-level objective: per-request limits, percentile limits and run-level targets."""

    name: str
    description: str = ""
    source: str = ""
    per_request: PerRequestObjectives = field(default_factory=PerRequestObjectives)
    percentiles: tuple[PercentileObjective, ...] = ()
    attainment_min: float | None = None
    error_rate_max: float | None = None
    min_samples: int = 0
    confidence: float = 0.95
    early_stopping_confidence: float = 0.99
    slices: tuple[SliceOverride, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SLOError("an SLO spec needs a non-empty name.")
        if not isinstance(self.per_request, PerRequestObjectives):
            raise SLOError("per_request must be a PerRequestObjectives.")
        object.__setattr__(self, "percentiles", tuple(self.percentiles))
        object.__setattr__(self, "slices", tuple(self.slices))
        if not all(isinstance(p, PercentileObjective) for p in self.percentiles):
            raise SLOError("percentiles must be PercentileObjective entries.")
        if not all(isinstance(s, SliceOverride) for s in self.slices):
            raise SLOError("slices must be SliceOverride entries.")
        if self.attainment_min is not None:
            v = _fraction(self.attainment_min, "attainment_min", allow_zero=False)
            object.__setattr__(self, "attainment_min", v)
        if self.error_rate_max is not None:
            v = _fraction(self.error_rate_max, "error_rate_max", allow_zero=True)
            object.__setattr__(self, "error_rate_max", v)
        n = self.min_samples
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise SLOError(f"min_samples must be a non-negative integer, not {n!r}.")
        for key in ("confidence", "early_stopping_confidence"):
            c = getattr(self, key)
            if isinstance(c, bool) or not isinstance(c, int | float) or not 0.5 <= c < 1:
                raise SLOError(f"{key} must be a fraction in [0.5, 1), such as 0.95, not {c!r}.")
            object.__setattr__(self, key, float(c))
        names = [s.name for s in self.slices]
        if len(set(names)) != len(names):
            raise SLOError("slice override names must be unique.")

    @classmethod
    def from_dict(cls, data, origin: str = "SLO spec") -> SLOSpec:
        """Build from a parsed YAML/JSON mapping; `origin` names it in error messages."""
        data = _mapping(data, origin)
        _check_keys(data, _TOP_LEVEL, origin)
        if "name" not in data:
            raise SLOError(f"{origin} is missing 'name'.")
        percentiles = data.get("percentiles") or []
        if not isinstance(percentiles, list):
            raise SLOError(f"{origin}: percentiles must be a list of objectives.")
        slices = data.get("slices") or []
        if not isinstance(slices, list):
            raise SLOError(f"{origin}: slices must be a list of overrides.")
        for key in ("description", "source"):
            if not isinstance(data.get(key, ""), str):
                raise SLOError(f"{origin}: {key} must be text.")
        try:
            return cls(
                name=data["name"],
                description=data.get("description", ""),
                source=data.get("source", ""),
                per_request=PerRequestObjectives.from_dict(
                    data.get("per_request") or {}, "per_request"
                ),
                percentiles=tuple(
                    PercentileObjective.from_dict(p, f"percentiles[{i}]")
                    for i, p in enumerate(percentiles)
                ),
                attainment_min=data.get("attainment_min"),
                error_rate_max=data.get("error_rate_max"),
                min_samples=data.get("min_samples", 0),
                confidence=data.get("confidence", 0.95),
                early_stopping_confidence=data.get("early_stopping_confidence", 0.99),
                slices=tuple(
                    SliceOverride.from_dict(s, f"slices[{i}]") for i, s in enumerate(slices)
                ),
            )
        except SLOError as exc:
            if str(exc).startswith(origin):
                raise
            raise SLOError(f"{origin}: {exc}") from None

    def to_dict(self) -> dict:
        """A plain, JSON- and YAML-serialisable dict that `from_dict` reads back."""
        return {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "per_request": asdict(self.per_request),
            "percentiles": [asdict(p) for p in self.percentiles],
            "attainment_min": self.attainment_min,
            "error_rate_max": self.error_rate_max,
            "min_samples": self.min_samples,
            "confidence": self.confidence,
            "early_stopping_confidence": self.early_stopping_confidence,
            "slices": [
                {
                    "name": s.name,
                    "input_tokens": list(s.input_tokens),
                    "output_tokens": list(s.output_tokens),
                    "per_request": asdict(s.per_request),
                }
                for s in self.slices
            ],
        }


def builtin_names() -> list[str]:
    """Names of the SLO specs shipped in slo/specs/ (without the .yaml suffix)."""
    specs = resources.files("slo") / "specs"
    return sorted(p.name[: -len(".yaml")] for p in specs.iterdir() if p.name.endswith(".yaml"))


def _parse_yaml(text: str, origin: str) -> SLOSpec:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise SLOError(f"{origin} is not valid YAML{at}; fix its syntax.") from None
    return SLOSpec.from_dict(data, origin)


def load_slo(name_or_path: str | Path) -> SLOSpec:
    """Load an SLO spec from a YAML file path, or by built-in name (`p99` or `p99.yaml`).

    A path wins when such a file exists. Raises `SLOError` for an unknown name (listing the
    built-ins), unreadable files and schema violations.
    """
    path = Path(name_or_path)
    if path.is_file():
        try:
            text = path.read_text()
        except OSError as exc:
            raise SLOError(f"cannot read SLO spec {path} ({exc.strerror}).") from None
        return _parse_yaml(text, str(path))
    name = path.name
    for suffix in (".yaml", ".yml"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    known = builtin_names()
    if str(name_or_path) not in (name, f"{name}.yaml", f"{name}.yml") or name not in known:
        raise SLOError(
            f"no SLO spec file or built-in named {str(name_or_path)!r}; built-ins: {', '.join(known)}."
        )
    resource = resources.files("slo") / "specs" / f"{name}.yaml"
    return _parse_yaml(resource.read_text(), f"built-in SLO {name!r}")


def as_spec(slo_spec: SLOSpec | dict | str | Path) -> SLOSpec:
    """Accept a spec, its dict form (as in manifest.json) or a name/path for `load_slo`."""
    if isinstance(slo_spec, SLOSpec):
        return slo_spec
    if isinstance(slo_spec, dict):
        return SLOSpec.from_dict(slo_spec)
    return load_slo(slo_spec)
