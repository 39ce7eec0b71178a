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
  arrivals                 {process: poisson|gamma|constant|all_at_once|ramp|stages|trace|closed_loop, ...}
  prefix                   optional shared prefixes {groups, prefix_len, assign}
  constraint               optional output constraint of every request: one of json_schema,
                           json_object, regex, choice, grammar (see workloads/constraint.py)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from workloads.constraint import check_constraint
from workloads.schema import WorkloadError

TOP_LEVEL_KEYS = {
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
    "notes",
}
SOURCE_KINDS = {
    "synthetic": {"kind", "input", "output"},
    "mix": {"kind", "components", "interleave"},
    "sharegpt": {
        "kind",
        "path",
        "fallback",
        "min_prompt_tokens",
        "max_prompt_tokens",
        "min_output_tokens",
        "max_total_tokens",
        "shuffle",
        "skip_malformed",
    },
    "trace": {"kind", "format", "path", "skip_malformed", "sample", "model", "log_type"},
    "sessions": {"kind", "turns", "input", "output", "think_ms", "path", "max_turns", "shuffle"},
}


@dataclass(frozen=True)
class WorkloadSpec:
    """A parsed, checked spec. `data` is the mapping as written; `origin` says where it came
    from (a built-in name or a file path); `base_dir` resolves relative paths inside it."""

    name: str
    data: dict[str, Any]
    origin: str
    base_dir: Path | None = None

    @property
    def description(self) -> str:
        return str(self.data.get("description", "")).strip()


def _expect(cond: bool, origin: str, message: str) -> None:
    if not cond:
        raise WorkloadError(f"{origin}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_spec(data: Any, origin: str) -> None:
    """Raise `WorkloadError` (naming `origin`) if `data` does not follow the spec schema."""
    _expect(isinstance(data, dict), origin, "a workload spec must be a YAML mapping.")
    unknown = set(data) - TOP_LEVEL_KEYS
    _expect(
        not unknown,
        origin,
        f"unknown key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(TOP_LEVEL_KEYS))}.",
    )
    n = data.get("num_requests", 100)
    _expect(
        n is None or (_is_int(n) and n >= 1),
        origin,
        f"num_requests must be a positive integer, got {n!r}.",
    )
    seed = data.get("seed", 0)
    _expect(
        _is_int(seed) and seed >= 0, origin, f"seed must be a non-negative integer, got {seed!r}."
    )
    _expect(
        isinstance(data.get("ignore_eos", True), bool), origin, "ignore_eos must be true or false."
    )
    _expect(
        data.get("endpoint", "completions") in ("completions", "chat"),
        origin,
        "endpoint must be completions or chat.",
    )
    for key in ("temperature", "top_p"):
        v = data.get(key)
        _expect(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0),
            origin,
            f"{key} must be a non-negative number or null.",
        )
    d = data.get("duration_s")
    _expect(
        d is None or (isinstance(d, (int, float)) and 0 < d < math.inf),
        origin,
        "duration_s must be a positive number.",
    )
    source = data.get("source", {"kind": "synthetic"})
    _expect(
        isinstance(source, dict) and source.get("kind") in SOURCE_KINDS,
        origin,
        f"source must be a mapping with kind one of {', '.join(SOURCE_KINDS)}.",
    )
    extra = set(source) - SOURCE_KINDS[source["kind"]]
    _expect(
        not extra,
        origin,
        f"source kind {source['kind']!r} does not take {', '.join(sorted(extra))}.",
    )
    if source["kind"] == "synthetic":
        _expect(
            "input" in source and "output" in source,
            origin,
            "a synthetic source needs input and output lengths.",
        )
    if source["kind"] == "sessions":
        _expect(
            ("path" in source) != ("turns" in source or "input" in source),
            origin,
            "a sessions source takes either path (ShareGPT conversations) or turns and input.",
        )
        _expect(
            "path" in source or {"turns", "input", "output"} <= set(source),
            origin,
            "synthetic sessions need turns, input and output lengths.",
        )
        m = source.get("max_turns")
        _expect(
            m is None or (_is_int(m) and m >= 1),
            origin,
            f"max_turns must be a positive integer, got {m!r}.",
        )
        _expect(data.get("prefix") is None, origin, "shared prefixes do not apply to sessions.")
    if source["kind"] == "mix":
        comps = source.get("components")
        _expect(
            isinstance(comps, list) and len(comps) >= 1,
            origin,
            "a mix source needs a list of components.",
        )
        for i, comp in enumerate(comps):
            _expect(
                isinstance(comp, dict)
                and {"input", "output"} <= set(comp)
                and set(comp) <= {"name", "weight", "input", "output"},
                origin,
                f"mix component {i} needs input and output (and optional name, weight).",
            )
            w = comp.get("weight", 1)
            _expect(
                isinstance(w, (int, float)) and w > 0,
                origin,
                f"mix component {i} weight must be positive.",
            )
        _expect(
            source.get("interleave", "alternate") in ("alternate", "random"),
            origin,
            "mix interleave must be alternate or random.",
        )
    if source["kind"] == "trace":
        _expect(
            source.get("format") in ("azure", "burstgpt", "mooncake"),
            origin,
            "a trace source needs format azure, burstgpt or mooncake.",
        )
        _expect(
            source.get("sample", "sequential") in ("sequential", "bootstrap"),
            origin,
            "trace sample must be sequential or bootstrap.",
        )
    arrivals = data.get("arrivals", {"process": "all_at_once"})
    _expect(
        isinstance(arrivals, dict) and "process" in arrivals,
        origin,
        "arrivals must be a mapping with 'process'.",
    )
    if arrivals["process"] == "trace":
        _expect(source["kind"] == "trace", origin, "trace arrivals need a trace source.")
        extra = set(arrivals) - {"process", "speedup", "jitter_s"}
        _expect(not extra, origin, f"trace arrivals do not take {', '.join(sorted(extra))}.")
    if data.get("constraint") is not None:
        check_constraint(data["constraint"], origin)
    prefix = data.get("prefix")
    if prefix is not None:
        _expect(
            isinstance(prefix, dict) and set(prefix) <= {"groups", "prefix_len", "assign"},
            origin,
            "prefix must be a mapping of groups, prefix_len and assign.",
        )
        _expect(
            _is_int(prefix.get("groups")) and prefix["groups"] >= 1,
            origin,
            "prefix.groups must be a positive integer.",
        )
        _expect(
            _is_int(prefix.get("prefix_len")) and prefix["prefix_len"] >= 1,
            origin,
            "prefix.prefix_len must be a positive integer.",
        )
        _expect(
            prefix.get("assign", "round_robin") in ("round_robin", "random"),
            origin,
            "prefix.assign must be round_robin or random.",
        )
        _expect(
            source["kind"] in ("synthetic", "mix", "trace")
            and not (source["kind"] == "trace" and source.get("format") == "mooncake"),
            origin,
            "shared prefixes apply to synthetic, mix and azure/burstgpt trace sources.",
        )


def parse_spec(text: str, origin: str, *, base_dir: Path | None = None) -> WorkloadSpec:
    """Parse YAML text into a checked spec; `origin` names it in error messages."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{origin}: not valid YAML ({str(exc).splitlines()[0]}).") from None
    check_spec(data, origin)
    name = str(data.get("name") or Path(origin).stem)
    return WorkloadSpec(name=name, data=data, origin=origin, base_dir=base_dir)


def load_spec_file(path: Path) -> WorkloadSpec:
    """Read and check a YAML spec file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"Cannot read workload spec {path} ({exc.strerror}).") from None
    return parse_spec(text, str(path), base_dir=Path(path).resolve().parent)
