"""The JSON documents of a run directory: `manifest.json` and `summary.json`.

Both are frozen dataclasses with a `schema_version`; `from_json` refuses a version this code
does not know, and unknown fields, in one sentence each, so a reader never guesses.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from slo.runrecord.bounds_sections import Bounds
from slo.runrecord.dense_sections import Dense
from slo.runrecord.disaggregation_sections import Disaggregation
from slo.runrecord.errors import RunRecordError
from slo.runrecord.memory_sections import Memory
from slo.runrecord.overload_sections import Overload
from slo.runrecord.reasoning_sections import Reasoning
from slo.runrecord.section import nested, plain, read_fields
from slo.runrecord.sections import (
    Chunking,
    Correctness,
    DispatchLag,
    Latencies,
    Ledger,
    LittleLaw,
    OutcomeCounts,
    PromptTokens,
    Saturation,
    ServerMetrics,
    Sessions,
    ThroughputRates,
)
from slo.runrecord.slo_sections import (
    Conventions,
    Deadlines,
    Fairness,
    Faults,
    Goodput,
    Slices,
    SLOEvaluation,
)

MANIFEST_SCHEMA_VERSION = 1
SUMMARY_SCHEMA_VERSION = 1


def _check_document(cls, data: Any, what: str, version: int) -> dict:
    if not isinstance(data, dict):
        raise RunRecordError(f"{what} must be a JSON object, got {type(data).__name__}.")
    found = data.get("schema_version")
    if found != version:
        raise RunRecordError(
            f"{what} has schema_version {found!r}; this version of bench reads only "
            f"{version}: use the bench release that wrote it."
        )
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RunRecordError(
            f"{what} has fields this version of bench does not know ({', '.join(unknown)})."
        )
    return data


@dataclass(frozen=True)
class RunManifest:
    """What was run, against what, and how it ended (`manifest.json`).

    Nested sections stay plain JSON objects: `target` (`kind`, `url`, `model`, `endpoint`,
    `engine`, `engine_version`, `dtype`, `engine_config`, `server_log`), `hardware`,
    `versions`, `workload` (the workload manifest, with its `sha256`), `slo` (the spec's dict
    or None), `fault_plan`, `config` (the run config). `t0_ns` is the `perf_counter_ns()` that
    every relative time in the tables is measured from. `complete` is false until the run
    finished normally; `interrupted_reason` says why not.
    """

    schema_version: int = MANIFEST_SCHEMA_VERSION
    harness_version: str | None = None
    git_sha: str | None = None
    command_line: list[str] | str | None = None
    run_id: str | None = None
    target: dict = field(default_factory=dict)
    hardware: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    slo: dict | None = None
    fault_plan: dict | None = None
    started_at: str | None = None
    t0_ns: int | None = None
    config: dict = field(default_factory=dict)
    complete: bool = False
    ended_at: str | None = None
    interrupted_reason: str | None = None
    num_requests_recorded: int | None = None
    num_warmup_recorded: int | None = None
    server_metrics_samples: int | None = None
    server_state: dict | None = None  # the target's idle gauges before and after the run
    outcome: dict | None = None  # how the run ended: exit code, reason, dominant error
    workers: dict | None = None  # `--workers`/`--ray`: count, why, clocks, per-worker facts
    energy: dict | None = None  # this host's energy counters over the measured phase (EnergyRecord)
    otlp: dict | None = None  # `bench run --otlp`: endpoint, spans sent and dropped, failures

    @classmethod
    def from_dict(cls, data: Any, *, what: str = "manifest.json") -> RunManifest:
        return cls(**_check_document(cls, data, what, MANIFEST_SCHEMA_VERSION))

    @classmethod
    def from_json(cls, text: str, *, what: str = "manifest.json") -> RunManifest:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise RunRecordError(f"{what} is not valid JSON ({exc}).") from exc
        return cls.from_dict(data, what=what)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str) + "\n"

    def evolve(self, **changes) -> RunManifest:
        """A copy with `changes` applied (the manifest itself never changes)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class RunSummary:
    """What `slo` computed from a run's tables (`summary.json`); see the `slo` package docstring
    for each section. The blocks are typed sections (`slo.runrecord.sections` and
    `slo_sections`): those every summary has read as an empty section when absent, the others
    as None. `conventions` is present only when asked for."""

    schema_version: int = SUMMARY_SCHEMA_VERSION
    definitions: dict = field(default_factory=dict)
    counts: OutcomeCounts = nested(OutcomeCounts, always=True)
    error_rate: float | None = None
    window_s: float | None = None
    throughput: ThroughputRates = nested(ThroughputRates, always=True)
    latency_ms: Latencies = nested(Latencies, always=True)
    dispatch_lag_ms: DispatchLag = nested(DispatchLag, always=True)
    client_bound: bool = False
    client_bound_threshold_ms: float | None = None
    output_tokens_source: str | None = None
    output_tokens_source_counts: dict = field(default_factory=dict)
    ci_confidence: float | None = None
    run_complete: bool | None = None
    run_stop_reason: str | None = None  # why the run stopped early (manifest interrupted_reason)
    little_law: LittleLaw | None = nested(LittleLaw)
    slices: Slices = nested(Slices, always=True)
    slo: SLOEvaluation | None = nested(SLOEvaluation)
    goodput: Goodput | None = nested(Goodput)
    ledger: Ledger | None = nested(Ledger)
    faults: Faults | None = nested(Faults)
    prompt_tokens: PromptTokens | None = nested(PromptTokens)  # usage against the workload's
    server_metrics: ServerMetrics | None = nested(ServerMetrics)  # the target's /metrics
    correctness: Correctness | None = nested(Correctness)  # outputs against the reference
    conventions: Conventions | None = nested(Conventions)
    streamed: bool | None = None  # None: a summary written before the field
    undefined_metrics: dict = field(default_factory=dict)  # metric -> why it has no value
    saturation: Saturation | None = nested(Saturation)
    chunking: Chunking | None = nested(Chunking)  # tokens per token-bearing chunk, and by what
    sessions: Sessions | None = nested(Sessions)  # multi-turn runs (`slo.sessions`)
    fairness: Fairness | None = nested(Fairness)  # runs whose requests have tenants
    deadlines: Deadlines | None = nested(Deadlines)  # runs whose requests have deadlines
    # The engine and the code path that served the run, from the manifest's target: engine,
    # engine_version, dtype, dtype_choice, quantization, kernels (the reference engine's `/info` says them).
    served_by: dict | None = None
    overload: Overload | None = nested(Overload)  # load phases and shedding (`slo.overload`)
    memory: Memory | None = nested(Memory)  # memory per request (`slo.memory`)
    # lower bounds against the run, Little's law per phase, cost and energy (`slo.bounds`)
    bounds: Bounds | None = nested(Bounds)
    # reasoning models' first tokens, TPOTs and counts (`slo.reasoning`); None: no reasoning
    reasoning: Reasoning | None = nested(Reasoning)
    dense: Dense | None = nested(Dense)  # embeddings and rerank runs (`slo.dense`)
    # a cluster's KV handoffs and serving workers (`slo.disaggregation`); None: none said
    disaggregation: Disaggregation | None = nested(Disaggregation)

    @classmethod
    def from_dict(cls, data: Any, *, what: str = "summary.json") -> RunSummary:
        """The summary of the dict `data` (what `slo.summarize` returns, or summary.json)."""
        return cls(**read_fields(cls, _check_document(cls, data, what, SUMMARY_SCHEMA_VERSION)))

    @classmethod
    def from_json(cls, text: str, *, what: str = "summary.json") -> RunSummary:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise RunRecordError(f"{what} is not valid JSON ({exc}).") from exc
        return cls.from_dict(data, what=what)

    def to_dict(self) -> dict:
        """The JSON object: every field in order, each section as its dict; `conventions`
        left out when None."""
        data = {f.name: plain(getattr(self, f.name)) for f in fields(self)}
        if data["conventions"] is None:
            del data["conventions"]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str) + "\n"


def write_json_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and a rename, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
