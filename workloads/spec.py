"""Workload specs: YAML files (built-in or the user's), schema-checked with clear errors.

A spec is a mapping with these keys (see `builtin/*.yaml` for examples):
  name, description        text
  num_requests             int (default 100; traces: all rows)
  seed                     int (default 0)
  ignore_eos               bool (default true)
  endpoint                 completions | chat (default completions)
  temperature, top_p       floats or null (null = server default)
  duration_s               optional: generate open-loop arrivals until this time
  source                   where lengths (and prompts, timestamps) come from; `kind` is one of
                           synthetic {input, output}, mix {components, interleave},
                           sharegpt {path, fallback, rules...}, trace {format, path, ...},
                           sessions {turns, input, output, think_ms | path, max_turns, output}
                           (one module each in `workloads/sources/`)
  arrivals                 {process: poisson|gamma|constant|all_at_once|ramp|stages|trace|closed_loop, ...}
  prefix                   optional shared prefixes {groups, prefix_len, assign}
  constraint               optional output constraint of every request: one of json_schema,
                           json_object, regex, choice, grammar (see workloads/constraint.py)
  tools, tool_choice       optional functions every request offers, and auto | required | none
                           | a function's name (chat only; see workloads/tools.py)
  priority, deadline_ms,   optional request classes: each request's priority, deadline and
  tenants                  tenant (see workloads/classes.py)

A mistake is one sentence in the form of `bench_common.yaml_spec`, with the line:
`mine.yaml:7: source.components[1].weight: got -1; expected a number > 0.`
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from workloads.classes import RequestClasses, classes_from_spec
from workloads.constraint import check_constraint
from workloads.options import ENDPOINTS
from workloads.schema import WorkloadError
from workloads.sources import Source, source_from_dict
from workloads.sources.base import at
from workloads.tools import tools_from_spec

TOP_LEVEL_KEYS = (
    "name",
    "description",
    "num_requests",
    "seed",
    "ignore_eos",
    "endpoint",
    "temperature",
    "top_p",
    "duration_s",
    "source",
    "arrivals",
    "prefix",
    "constraint",
    "tools",
    "tool_choice",
    "priority",
    "deadline_ms",
    "tenants",
    "notes",
)
PROCESSES = (
    "poisson",
    "gamma",
    "constant",
    "all_at_once",
    "ramp",
    "stages",
    "trace",
    "closed_loop",
)
ASSIGNS = ("round_robin", "random")


@dataclass(frozen=True)
class PrefixSpec:
    """Shared prefixes: `groups` distinct prefixes of `prefix_len` tokens, each request given
    one (`assign`: round_robin or random) before its own suffix."""

    groups: int
    prefix_len: int
    assign: str = "round_robin"

    def __post_init__(self) -> None:
        ys.number(self.groups, at("groups"), minimum=1, integer=True)
        ys.number(self.prefix_len, at("prefix_len"), minimum=1, integer=True)
        ys.enum_member(self.assign, at("assign"), ASSIGNS)

    @classmethod
    def from_dict(cls, data: Any, where: Where | str) -> PrefixSpec:
        names = ("groups", "prefix_len", "assign")
        return ys.from_mapping(cls, data, at(where), names, required=("groups", "prefix_len"))


@dataclass(frozen=True)
class WorkloadSpec:
    """A parsed, checked spec. `data` is the mapping as written (the manifest records it and
    the cache key hashes it); the other fields are what a build reads, with the defaults of
    the module docstring (`num_requests_given` tells a written `null` from no key: a trace
    replays all its rows either way, other sources default to 100). `origin` says where the
    spec came from (a built-in name or a file path), `base_dir` resolves relative paths
    inside it, and `where` places its keys, lines included, for messages at build time."""

    name: str
    data: dict[str, Any]
    origin: str
    source: Source
    base_dir: Path | None = None
    num_requests: int | None = None
    num_requests_given: bool = False
    seed: int = 0
    ignore_eos: bool = True
    endpoint: str = "completions"
    temperature: float | None = None
    top_p: float | None = None
    duration_s: float | None = None
    arrivals: dict[str, Any] = field(default_factory=lambda: {"process": "all_at_once"})
    prefix: PrefixSpec | None = None
    constraint: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    classes: RequestClasses = field(default_factory=RequestClasses)
    where: Where = field(default_factory=Where, compare=False, repr=False)

    @property
    def description(self) -> str:
        return str(self.data.get("description") or "").strip()

    @classmethod
    def from_dict(
        cls, data: Any, where: Where | str, *, base_dir: Path | None = None
    ) -> WorkloadSpec:
        """Check `data` (a parsed spec) and read it; `where` is its origin, or the root
        `Where` of `bench_common.yaml_spec.load`, which also knows the lines."""
        root = ys.root(where, WorkloadError)
        data = ys.document(data, root, TOP_LEVEL_KEYS)
        for key in ("name", "description"):
            if data.get(key) is not None:
                ys.string(data[key], root / key)
        if data.get("num_requests") is not None:
            ys.number(data["num_requests"], root / "num_requests", minimum=1, integer=True)
        ys.number(data.get("seed", 0), root / "seed", minimum=0, integer=True)
        ys.boolean(data.get("ignore_eos", True), root / "ignore_eos")
        ys.enum_member(data.get("endpoint", "completions"), root / "endpoint", ENDPOINTS)
        for key in ("temperature", "top_p"):
            if data.get(key) is not None:
                ys.number(data[key], root / key, minimum=0)
        if data.get("duration_s") is not None:
            ys.number(data["duration_s"], root / "duration_s", above=0)
        source = source_from_dict(data.get("source", {"kind": "synthetic"}), root / "source")
        arrivals = _arrivals(data.get("arrivals", {"process": "all_at_once"}), root, source)
        if data.get("constraint") is not None:
            check_constraint(data["constraint"], (root / "constraint").place)
        tools, tool_choice = tools_from_spec(data, root, source.kind)
        classes = classes_from_spec(data, root)
        prefix = None
        if data.get("prefix") is not None:
            prefix = PrefixSpec.from_dict(data["prefix"], root / "prefix")
            if not source.takes_prefix:
                (root / "prefix").fail(
                    f"shared prefixes do not apply to this {source.kind} source",
                    "they apply to synthetic, mix and azure/burstgpt trace sources",
                )
        return cls(
            name=str(data.get("name") or Path(root.origin).stem),
            data=data,
            origin=root.origin,
            source=source,
            base_dir=base_dir,
            num_requests=data.get("num_requests"),
            num_requests_given="num_requests" in data,
            seed=data.get("seed", 0),
            ignore_eos=data.get("ignore_eos", True),
            endpoint=data.get("endpoint", "completions"),
            temperature=data.get("temperature"),
            top_p=data.get("top_p"),
            duration_s=data.get("duration_s"),
            arrivals=arrivals,
            prefix=prefix,
            constraint=data.get("constraint"),
            tools=tools,
            tool_choice=tool_choice,
            classes=classes,
            where=root,
        )


def _arrivals(value: Any, root: Where, source: Source) -> dict[str, Any]:
    """The arrivals mapping, its process known (the process's own keys are checked when the
    workload is built, by `workloads.arrivals.arrivals_from_spec`)."""
    where = root / "arrivals"
    arrivals = ys.mapping(value, where)
    if "process" not in arrivals:
        where.fail("missing key 'process'", f"expected one of {', '.join(PROCESSES)}")
    ys.enum_member(arrivals["process"], where / "process", PROCESSES)
    if arrivals["process"] == "trace":
        if source.kind != "trace":
            (where / "process").fail(
                "trace arrivals need a trace source", "use another process, or a trace source"
            )
        ys.keys(arrivals, where, ("process", "speedup", "jitter_s"))
        ys.number(arrivals.get("speedup", 1.0), where / "speedup", above=0)
        ys.number(arrivals.get("jitter_s", 0.0), where / "jitter_s", minimum=0)
    return arrivals


def parse_spec(text: str, origin: str, *, base_dir: Path | None = None) -> WorkloadSpec:
    """Parse YAML text into a checked spec; `origin` names it in error messages."""
    data, root = ys.load(text, origin, error=WorkloadError)
    return WorkloadSpec.from_dict(data, root, base_dir=base_dir)


def load_spec_file(path: Path) -> WorkloadSpec:
    """Read and check a YAML spec file."""
    data, root = ys.load_file(path, error=WorkloadError, what="workload spec")
    return WorkloadSpec.from_dict(data, root, base_dir=Path(path).resolve().parent)
