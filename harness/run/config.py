"""The run configuration: built once (from the CLI or a library caller) and passed down.

`RunConfig` is four parts, each validated where it is defined: `load` (the workload and how it
is paced), `server` (the target: `harness.targets.config.TargetConfig`), `recording` (where the
run goes and what is measured and checked) and `stop` (the rules that end a run early), and
`faults` (a fault plan's name, which the CLI composes into the run). It is built from the parts
or from flat names, one per `bench run` flag, which are also the keys of the manifest's
`config` section (`to_dict`).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

from harness.errors import HarnessError, check_positive
from harness.run.dense_plan import parse_batch_size
from harness.targets.config import TargetConfig
from harness.targets.spec import TargetSpec

WORKER_FAILURE_POLICIES = ("continue", "stop")


def parse_workers(value) -> int | str:
    """`--workers`: a whole number of at least 1, or `auto`; anything else is one sentence."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            raise HarnessError(
                f"--workers must be a whole number of at least 1 or auto, got {value!r}."
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HarnessError(
            f"--workers must be a whole number of at least 1 or auto, got {value!r}."
        )
    return value


@dataclass(frozen=True)
class LoadConfig:
    """What is sent and when. `None` for a workload field means the workload's default.

    - `request_rate`: requests/s (`inf`: all at once); with `concurrency` alone the run is
      closed loop with that many users; with both, `concurrency` caps in-flight requests.
    - `warmup`: requests sent before the measured phase and excluded from its metrics.
    - `session_header`: multi-turn workloads send each turn's session id in this header.
    - `workers`: split the schedule across this many local worker processes
      (`harness.load.split`), or `"auto"` (from the cores and the expected rate); None: one
      process (with `ray_address`, one Ray actor per node). `ray_address` (`auto`, `local` or
      host:port) runs the workers as Ray actors.
    - `batch_size`: embeddings and rerank only, the texts each request carries: a whole number
      or a length distribution (`harness.run.dense_plan`); None: one.
    """

    workload: str = "random"
    num_requests: int | None = None
    duration_s: float | None = None
    request_rate: float | None = None
    burstiness: float | None = None
    concurrency: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float | None = None
    ignore_eos: bool | None = None
    dataset_path: str | None = None
    seed: int | None = None  # None: the workload spec's own seed
    warmup: int = 0
    session_header: str | None = None
    workers: int | str | None = None
    ray_address: str | None = None
    batch_size: int | dict | None = None  # embeddings, rerank: texts a request (`dense_plan`)

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_size", parse_batch_size(self.batch_size))
        for name in ("num_requests", "concurrency", "input_len", "output_len"):
            check_positive(name, getattr(self, name), integer=True)
        for name in ("duration_s", "request_rate", "burstiness"):
            check_positive(name, getattr(self, name))
        if self.session_header is not None and not re.fullmatch(
            r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", self.session_header
        ):
            raise HarnessError(
                f"--session-header must be an HTTP header name (letters, digits, -), got {self.session_header!r}."
            )
        if self.warmup < 0:
            raise HarnessError(f"--warmup must be zero or more, got {self.warmup!r}.")
        if self.workers is not None:
            object.__setattr__(self, "workers", parse_workers(self.workers))
        if self.burstiness is not None and self.request_rate in (None, math.inf):
            raise HarnessError("--burstiness needs a finite --request-rate to shape.")

    @property
    def is_closed_loop(self) -> bool:
        return self.request_rate is None and self.concurrency is not None

    @property
    def is_split(self) -> bool:
        """The schedule runs in worker processes or Ray actors, not in this process alone."""
        return self.ray_address is not None or self.workers not in (None, 1)


@dataclass(frozen=True)
class RecordingConfig:
    """Where the run is recorded and what is measured and checked besides the requests.

    - `out`: the run directory (default `runs/<time>-<workload>`); `slo`: a spec's name or
      file, or a spec dict (`--goodput`).
    - `client_bound_ms`: dispatch-lag p99 above this marks the run `client_bound`.
    - `flush_interval_s`: how often recorded results are written; `scrape_interval_s`: how
      often the target's `/metrics` is sampled into `server_metrics.parquet` (0: never;
      targets without `/metrics` are skipped); `settle_s`: how long the target has to go
      idle after the run (the ledger's leak check).
    - `slice_duration_s`: fixed-width time slices on the card.
    - `check_outputs`: greedy requests, each output compared with the reference engine's
      batch-1 output (`harness.run.oracle`); an output diverging before `diverge_before` tokens
      is `wrong output`.
    - `cost_per_hour`: what the target costs, US dollars an hour (0 or more), for the cost per
      million output tokens at the SLO (`slo.cost`); None: no cost figures.
    - `memory_budget_mb`: what the summary and the card may hold of the run's chunks (MB):
      pooled chunk gaps are exact while they fit, a quantile sketch beyond (`slo.sketch`).
    """

    out: Path | None = None
    slo: str | dict | None = None
    client_bound_ms: float = 10.0
    flush_interval_s: float = 5.0
    scrape_interval_s: float = 1.0
    settle_s: float = 10.0
    slice_duration_s: float | None = None
    check_outputs: bool = False
    diverge_before: int = 32
    cost_per_hour: float | None = None
    memory_budget_mb: float = 512.0

    def __post_init__(self) -> None:
        for name in ("client_bound_ms", "slice_duration_s", "memory_budget_mb"):
            check_positive(name, getattr(self, name))
        if self.settle_s < 0:
            raise HarnessError(f"settle_s must be zero or more, got {self.settle_s!r}.")
        if self.diverge_before < 0:
            raise HarnessError(
                f"--diverge-before must be zero or more, got {self.diverge_before!r}."
            )
        cost = self.cost_per_hour
        number = isinstance(cost, int | float) and not isinstance(cost, bool)
        if cost is not None and not (number and 0 <= cost < math.inf):
            raise HarnessError(
                f"--cost-per-hour must be a dollar amount of zero or more, got {cost!r}."
            )


@dataclass(frozen=True)
class StopRules:
    """What ends a run early (exit 3): more than `max_error_rate` (0-1) of its requests
    failed, `max_consecutive_errors` failed in a row, or with `stop_on_saturation` its TTFT
    and in-flight requests kept rising together; and `on_worker_failure` (`continue` or
    `stop`): what a dead worker does to the others."""

    max_error_rate: float | None = None
    max_consecutive_errors: int | None = None
    stop_on_saturation: bool = False
    on_worker_failure: str = "continue"

    def __post_init__(self) -> None:
        if self.max_error_rate is not None and not 0 <= self.max_error_rate < 1:
            raise HarnessError(
                f"--max-error-rate must be at least 0 and below 1, got {self.max_error_rate!r}."
            )
        check_positive("max_consecutive_errors", self.max_consecutive_errors, integer=True)
        if self.on_worker_failure not in WORKER_FAILURE_POLICIES:
            raise HarnessError(
                f"--on-worker-failure must be one of {', '.join(WORKER_FAILURE_POLICIES)}, "
                f"got {self.on_worker_failure!r}."
            )


PARTS = {
    "load": LoadConfig,
    "server": TargetConfig,
    "recording": RecordingConfig,
    "stop": StopRules,
}
SPEC_FLAGS = ("target", "url")  # the flat names `TargetConfig.spec` is parsed from
# flat name -> the part that holds it (`spec` is given as SPEC_FLAGS)
PART_OF = {f.name: part for part, cls in PARTS.items() for f in fields(cls) if f.name != "spec"}
PART_OF.update(dict.fromkeys(SPEC_FLAGS, "server"))

# The manifest's `config` keys, in the order run directories have always written them (every
# flat name but `api_key`, which is never recorded).
MANIFEST_KEYS = (
    "workload", "url", "model", "endpoint", "stream", "chunk_usage", "num_requests",
    "duration_s", "request_rate", "burstiness", "concurrency", "input_len", "output_len",
    "range_ratio", "ignore_eos", "dataset_path", "seed", "warmup", "timeout_s", "out", "slo",
    "tokenizer", "client_bound_ms", "flush_interval_s", "scrape_interval_s", "server_args",
    "startup_timeout_s", "max_error_rate", "max_consecutive_errors", "stop_on_saturation",
    "settle_s", "faults", "headers", "extra_body", "session_header", "slice_duration_s",
    "target", "engine_commands", "engine_pythons", "check_outputs", "diverge_before",
    "workers", "ray_address", "on_worker_failure", "cost_per_hour", "batch_size",
    "memory_budget_mb",
)  # fmt: skip


@dataclass(frozen=True, init=False)
class RunConfig:
    """Everything `bench run` needs, in parts (see the module docstring).

    `RunConfig(load=..., server=..., recording=..., stop=..., faults=...)` takes the parts
    (each defaults to its own defaults); flat names (`RunConfig(url=..., num_requests=5)`,
    as the flags and the manifest name them) replace that field of their part, so
    `dataclasses.replace(config, request_rate=2.0)` changes one field. `target` and `url` are
    parsed into `server.spec` once (`TargetSpec.parse`: `url` wins).
    """

    load: LoadConfig
    server: TargetConfig
    recording: RecordingConfig
    stop: StopRules
    faults: str | None  # a fault plan: built-in name or YAML file (`bench faults list`)

    def __init__(
        self,
        *,
        load: LoadConfig | None = None,
        server: TargetConfig | None = None,
        recording: RecordingConfig | None = None,
        stop: StopRules | None = None,
        faults: str | None = None,
        **flags,
    ) -> None:
        unknown = sorted(set(flags) - set(PART_OF))
        if unknown:
            raise TypeError(f"RunConfig got an unexpected keyword argument {unknown[0]!r}")
        given = {"load": load, "server": server, "recording": recording, "stop": stop}
        for name, cls in PARTS.items():
            part = given[name] or cls()
            changes = {k: v for k, v in flags.items() if PART_OF[k] == name and k not in SPEC_FLAGS}
            if name == "server" and any(k in flags for k in SPEC_FLAGS):
                was = part.spec.flags()
                changes["spec"] = TargetSpec.parse(
                    flags.get("target", was["target"]), flags.get("url", was["url"])
                )
            object.__setattr__(self, name, replace(part, **changes) if changes else part)
        object.__setattr__(self, "faults", faults)
        if self.faults is not None and self.load.is_split:
            raise HarnessError(
                "--faults and --workers/--ray cannot be combined yet: a fault plan wraps one "
                "process's transport, so run fault plans with a single worker."
            )

    def flat(self) -> dict:
        """Every setting under its flat name, as the flags gave it (`url` and `target` as
        `--url` and `--target` gave them)."""
        out = {"faults": self.faults}
        for name in PARTS:
            part = getattr(self, name)
            for f in fields(part):
                if f.name == "spec":
                    out.update(part.spec.flags())
                else:
                    out[f.name] = getattr(part, f.name)
        return out

    def to_dict(self) -> dict:
        """The manifest's `config` section: `MANIFEST_KEYS` in order, as JSON-ready values;
        no `api_key`, and only the names of the headers (their values often carry
        credentials)."""
        flat = self.flat()
        d = {key: copy.deepcopy(flat[key]) for key in MANIFEST_KEYS}
        d["out"] = str(flat["out"]) if flat["out"] else None
        d["request_rate"] = "inf" if flat["request_rate"] == math.inf else flat["request_rate"]
        for key in ("server_args", "engine_commands", "engine_pythons"):
            d[key] = list(flat[key])
        d["headers"] = [name for name, _ in flat["headers"]]
        return d
