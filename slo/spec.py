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
    ttft: first_token                 # which TTFT the objectives judge: first_token (of
                                      #   reasoning or answer, as vLLM) or first_answer_token
    slices:                           # per-slice overrides of per_request objectives
      - name: long_prompts
        input_tokens: [2048, null]    # [low, high): null = unbounded
        output_tokens: [null, null]
        per_request: {ttft_ms: 4000}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from slo.errors import SLOError

PERCENTILE_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "max_itl_ms", "e2e_ms")
# Which token TTFT ends at: the first of any kind (reasoning or answer; vLLM's), or the first
# answer token (after a reasoning model's thinking; `slo.reasoning`).
FIRST_TOKEN, FIRST_ANSWER_TOKEN = "first_token", "first_answer_token"
TTFT_CHOICES = (FIRST_TOKEN, FIRST_ANSWER_TOKEN)
_TOP_LEVEL = (
    "name", "description", "source", "per_request", "percentiles", "attainment_min",
    "error_rate_max", "min_samples", "confidence", "early_stopping_confidence", "slices", "ttft",
)  # fmt: skip


def _at(where: Where | str) -> Where:
    return ys.as_where(where, SLOError)


def _positive_ms(value, where: Where | str) -> float | None:
    if value is None:
        return None
    ys.number(
        value,
        _at(where),
        above=0,
        what="a number of milliseconds",
        hint="leave the key out for no limit",
    )
    return float(value)


def _fraction(value, where: Where | str, *, allow_zero: bool) -> float:
    low = {"minimum": 0} if allow_zero else {"above": 0}
    ys.number(value, _at(where), **low, maximum=1, what="a fraction", hint="write 0.99 for 99%")
    return float(value)


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
    def from_dict(cls, data, where: Where | str) -> PerRequestObjectives:
        return ys.from_mapping(cls, data, _at(where), tuple(f.name for f in fields(cls)))

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
        ys.enum_member(self.metric, _at("metric"), PERCENTILE_METRICS)
        ys.number(self.percentile, _at("percentile"), above=0, below=100, what="a percentile")
        object.__setattr__(self, "percentile", float(self.percentile))
        object.__setattr__(self, "max_ms", _positive_ms(self.max_ms, "max_ms"))

    @property
    def name(self) -> str:
        return f"{self.metric} p{self.percentile:g} <= {self.max_ms:g} ms"

    @classmethod
    def from_dict(cls, data, where: Where | str) -> PercentileObjective:
        names = ("metric", "percentile", "max_ms")
        return ys.from_mapping(cls, data, _at(where), names, required=names)


def _bounds(value, where: Where) -> tuple[float | None, float | None]:
    if value is None:
        return (None, None)
    if not isinstance(value, list | tuple) or len(value) != 2:
        where.fail(f"got {ys.describe(value)}", "expected a [low, high) pair such as [2048, null]")
    low, high = value
    for i, v in enumerate(value):
        if v is not None:
            ys.number(v, where / i, minimum=0, what="a token count or null")
    if low is not None and high is not None and not low < high:
        where.fail(f"low {low:g} is not below high {high:g}", "expected low < high")
    return (None if low is None else float(low), None if high is None else float(high))


@dataclass(frozen=True)
class SliceOverride:
    """Requests whose token counts fall in [low, high) get `per_request` limits instead."""

    name: str
    per_request: PerRequestObjectives
    input_tokens: tuple[float | None, float | None] = (None, None)
    output_tokens: tuple[float | None, float | None] = (None, None)

    def __post_init__(self) -> None:
        ys.string(self.name, _at("name"), nonempty=True)

    @classmethod
    def from_dict(cls, data, where: Where | str) -> SliceOverride:
        where = _at(where)
        data = ys.mapping(data, where)
        names = ("name", "input_tokens", "output_tokens", "per_request")
        ys.keys(data, where, names, required=("name",))
        with ys.relocating(where):
            return cls(
                name=data["name"],
                per_request=PerRequestObjectives.from_dict(
                    data.get("per_request", {}), where / "per_request"
                ),
                input_tokens=_bounds(data.get("input_tokens"), where / "input_tokens"),
                output_tokens=_bounds(data.get("output_tokens"), where / "output_tokens"),
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
    ttft: str = FIRST_TOKEN

    def __post_init__(self) -> None:
        ys.string(self.name, _at("name"), nonempty=True)
        ys.enum_member(self.ttft, _at("ttft"), TTFT_CHOICES)
        for key in ("description", "source"):
            ys.string(getattr(self, key), _at(key))
        if not isinstance(self.per_request, PerRequestObjectives):
            _at("per_request").fail(
                f"got {ys.describe(self.per_request)}", "expected a PerRequestObjectives"
            )
        object.__setattr__(self, "percentiles", tuple(self.percentiles))
        object.__setattr__(self, "slices", tuple(self.slices))
        for key, kind in (("percentiles", PercentileObjective), ("slices", SliceOverride)):
            for i, entry in enumerate(getattr(self, key)):
                if not isinstance(entry, kind):
                    (_at(key) / i).fail(f"got {ys.describe(entry)}", f"expected a {kind.__name__}")
        if self.attainment_min is not None:
            v = _fraction(self.attainment_min, "attainment_min", allow_zero=False)
            object.__setattr__(self, "attainment_min", v)
        if self.error_rate_max is not None:
            v = _fraction(self.error_rate_max, "error_rate_max", allow_zero=True)
            object.__setattr__(self, "error_rate_max", v)
        ys.number(self.min_samples, _at("min_samples"), minimum=0, integer=True)
        for key in ("confidence", "early_stopping_confidence"):
            c = getattr(self, key)
            ys.number(c, _at(key), minimum=0.5, below=1, what="a fraction", hint="such as 0.95")
            object.__setattr__(self, key, float(c))
        names = [s.name for s in self.slices]
        for i, name in enumerate(names):
            if name in names[:i]:
                (_at("slices") / i).fail(
                    f"the name {name!r} is taken", "give every slice override its own name"
                )

    @classmethod
    def from_dict(cls, data, origin: str | Where = "SLO spec") -> SLOSpec:
        """The spec a parsed YAML or JSON mapping describes. Errors name `origin`, and the
        line too when it is the root `Where` that `bench_common.yaml_spec.load` returned."""
        root = ys.root(origin, SLOError)
        data = ys.document(data, root, _TOP_LEVEL, required=("name",))
        percentiles = ys.sequence(
            data.get("percentiles") or [], root / "percentiles", what="a list of objectives"
        )
        slices = ys.sequence(data.get("slices") or [], root / "slices", what="a list of overrides")
        with ys.relocating(root):
            return cls(
                name=data["name"],
                description=data.get("description", ""),
                source=data.get("source", ""),
                per_request=PerRequestObjectives.from_dict(
                    data.get("per_request") or {}, root / "per_request"
                ),
                percentiles=tuple(
                    PercentileObjective.from_dict(p, root / "percentiles" / i)
                    for i, p in enumerate(percentiles)
                ),
                attainment_min=data.get("attainment_min"),
                error_rate_max=data.get("error_rate_max"),
                min_samples=data.get("min_samples", 0),
                confidence=data.get("confidence", 0.95),
                early_stopping_confidence=data.get("early_stopping_confidence", 0.99),
                slices=tuple(
                    SliceOverride.from_dict(s, root / "slices" / i) for i, s in enumerate(slices)
                ),
                ttft=data.get("ttft", FIRST_TOKEN),
            )

    def to_dict(self) -> dict:
        """A plain, JSON- and YAML-serialisable dict that `from_dict` reads back (`ttft` only
        when it is not the default, so a spec without it reads as it always did)."""
        extra = {} if self.ttft == FIRST_TOKEN else {"ttft": self.ttft}
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
            **extra,
        }


def builtin_names() -> list[str]:
    """Names of the SLO specs shipped in slo/specs/ (without the .yaml suffix)."""
    specs = resources.files("slo") / "specs"
    return sorted(p.name[: -len(".yaml")] for p in specs.iterdir() if p.name.endswith(".yaml"))


def _parse_yaml(text: str, origin: str) -> SLOSpec:
    data, root = ys.load(text, origin, error=SLOError)
    return SLOSpec.from_dict(data, root)


def load_slo(name_or_path: str | Path) -> SLOSpec:
    """Load an SLO spec from a YAML file path, or by built-in name (`p99` or `p99.yaml`).

    A path wins when such a file exists. Raises `SLOError` for an unknown name (listing the
    built-ins), unreadable files and schema violations.
    """
    path = Path(name_or_path)
    if path.is_file():
        data, root = ys.load_file(path, error=SLOError, what="SLO spec")
        return SLOSpec.from_dict(data, root)
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
