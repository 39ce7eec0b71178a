"""The report card: plain data about one run, with no rendering in it.

`reports.build.build_card` fills a `Card` from a run directory; the console, JSON and HTML views
all render the same object. `Card.to_dict()` is the versioned JSON form documented in
`reports/card_schema.md` (bump `CARD_SCHEMA_VERSION` when a field changes meaning or goes away).
Units are in the field names (`_ms`, `_s`, `_per_s`, `_bytes`); "no value" is None.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass

from slo.runrecord import (
    Bounds,
    Chunking,
    Conventions,
    Correctness,
    Deadlines,
    Dense,
    Disaggregation,
    Distribution,
    Fairness,
    FaultWindow,
    Goodput,
    Ledger,
    Overload,
    Reasoning,
    Saturation,
    Section,
    ServerMetrics,
    Sessions,
    TokenSource,
)

CARD_SCHEMA_VERSION = 1
_OMIT_WHEN_NONE = "omit_when_none"  # field metadata: no JSON key when the value is None
VERDICTS = ("pass", "fail", "inconclusive")
HEADLINES = ("pass", "fail", "inconclusive", "no_slo")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
FAILURE_KINDS = ("rejected", "timeout", "oom", "cancelled", "unknown", "wrong_output", "error")
# The card's goodput figures (card_schema.md), in order: the summary's block without its misses
# and definition.
GOODPUT_FIGURES = (
    "request_per_s",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "attainment",
    "good_requests",
    "total_requests",
)


@dataclass(frozen=True)
class SLOVerdict:
    """One objective of the SLO, e.g. "ttft_ms p99 <= 200", and slo's verdict on this run.

    `observed` and `threshold` are in `unit` (ms for percentile objectives, a fraction for
    attainment and error rate); `ci_low`/`ci_high` bound `observed`; `n` is the sample size
    and `reason` slo's one-line explanation. `verdict` is pass, fail or inconclusive.
    """

    objective: str
    metric: str
    unit: str
    observed: float | None
    threshold: float | None
    ci_low: float | None
    ci_high: float | None
    n: int | None
    verdict: str
    reason: str | None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"SLOVerdict.verdict must be one of {VERDICTS}, not {self.verdict!r}")


@dataclass(frozen=True)
class Throughput:
    """One labelled rate, e.g. ("output_tokens_per_s", "output tokens/s (ok requests)")."""

    name: str
    label: str
    value: float | None


@dataclass(frozen=True)
class LatencyRow:
    """One latency metric over the ok requests, ms. `p50_ci_ms` and `p99_ci_ms` are
    [low, high] bootstrap intervals, or None when not computed (too few values)."""

    metric: str
    n: int
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    p50_ci_ms: list[float] | None = None
    p99_ci_ms: list[float] | None = None


@dataclass(frozen=True)
class SliceRow:
    """One slice of the requests (`dimension` = `value`), e.g. input length bucket "<=128"."""

    dimension: str
    value: str
    n: int
    n_ok: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    e2e_p99_ms: float | None
    attainment: float | None = None


@dataclass(frozen=True)
class Failures:
    """The failure taxonomy: every request is counted once, in `ok` or one failure kind.

    `wrong_output` counts requests that finished `ok` but whose output is unusable (see
    `reports.taxonomy`); `error` is any other failure. `by_error_class` is the raw breakdown.
    """

    total: int
    ok: int
    rejected: int
    timeout: int
    oom: int
    cancelled: int
    unknown: int
    wrong_output: int
    error: int
    not_sent: int = 0
    by_error_class: dict[str, int] = field(default_factory=dict)
    first_message_by_error_class: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        """Requests sent that ended in any failure kind (not-sent ones were never tried)."""
        return self.total - self.ok - self.not_sent


@dataclass(frozen=True)
class Memory:
    """Memory per request where the target reports or its gauges allow an estimate
    (`reports.memory_view`: `source` says which), else `available` false with the reason.
    `per_request_bytes` is the peak KV bytes' (or the estimate's) distribution; `rows` one
    figure each (`label`, `unit` bytes or share, `n`, `p50`, `p99`, `max`); `note` what to read
    them with."""

    available: bool
    source: str | None = None
    per_request_bytes: dict | None = None
    reason: str | None = None
    rows: list[dict] = field(default_factory=list)
    note: str | None = None


@dataclass(frozen=True)
class ClientHealth:
    """Whether the load generator kept up: dispatch lag (send - schedule) and `client_bound`."""

    dispatch_lag_p50_ms: float | None
    dispatch_lag_p99_ms: float | None
    dispatch_lag_max_ms: float | None
    client_bound: bool | None
    client_bound_threshold_ms: float | None
    # `--workers`/`--ray`: one row per worker (see `reports.build.worker_rows`); empty: one process
    workers: tuple[dict, ...] = ()
    workers_clock: str | None = None  # how the workers' times were put on one timeline


@dataclass(frozen=True)
class Environment:
    """Where and how the run happened, copied from the manifest."""

    engine: str | None
    engine_version: str | None
    model: str | None
    target_kind: str | None
    target_url: str | None
    hardware: dict
    harness_version: str | None
    git_sha: str | None
    versions: dict
    workload_name: str | None
    workload_sha256: str | None
    workload_synthetic: bool | None
    command_line: str | None
    started_at: str | None
    ended_at: str | None
    complete: bool | None
    interrupted_reason: str | None
    # The code path that served the run, as the target's /info said: dtype, quantization, and
    # the reference engine's kernel level ("avx512-bf16", "off: <reason>"); None: not said.
    dtype: str | None = None
    quantization: str | None = None
    kernels: str | None = None
    # A lossy KV cache ("KV int8", "KV bf16, eviction sinks: 4 sink + 1024 window tokens");
    # None: exact (the engine's dtype, no eviction) or not said.
    kv_cache: str | None = None

    def engine_line(self) -> str:
        """ "engine_ref 0.1.0 · bfloat16 · kernels: avx512-bf16", what is known of it."""
        parts = [f"{self.engine or 'unknown engine'} {self.engine_version or ''}".strip()]
        parts += [p for p in (self.dtype, self.quantization, self.kv_cache) if p]
        if self.kernels:
            parts.append(f"kernels: {self.kernels}")
        return " · ".join(parts)


@dataclass(frozen=True)
class Series:
    """Chart data, already reduced to a bounded size.

    `cdf_ms`: metric -> [[value_ms, fraction], ...] (at most 101 points);
    `over_time`: metric -> [[t_s, p50_ms, p90_ms], ...] per time bin (send time);
    `failures_over_time`: [{t_s, ok, <failure kind>: count, ...}] per bin (done time);
    `fault_windows`: [{start_s, end_s, kind}]; `capacity`: [{rate, attainment, goodput}].
    """

    bin_s: float | None
    cdf_ms: dict
    over_time: dict
    failures_over_time: list
    fault_windows: list
    capacity: list


@dataclass(frozen=True)
class Card:
    """Everything the report shows about one run. The summary's blocks are carried as
    `slo.runrecord` sections; `to_dict` writes them as summary.json has them (goodput as
    `goodput_figures`)."""

    run_id: str
    headline: str
    slo_name: str | None
    slo_verdicts: list[SLOVerdict]
    goodput: Goodput | None
    throughput: list[Throughput]
    latency: list[LatencyRow]
    slices: list[SliceRow]
    failures: Failures
    memory: Memory
    client_health: ClientHealth
    environment: Environment
    series: Series
    window_s: float | None
    output_tokens_source: str | None
    notes: list[str] = field(default_factory=list)
    ledger: Ledger | None = None  # slo's ledger: lost, unexpected, leaked, outcomes, verdict
    faults: list[FaultWindow] = field(default_factory=list)  # recovery figures per fault window
    conventions: Conventions | None = None  # TTFT/TPOT/ITL/throughput under other tools' rules
    undefined_metrics: dict = field(default_factory=dict)  # metric -> why it has no value
    saturation: Saturation | None = None  # slo's over-saturation check
    server_metrics: ServerMetrics | None = None  # slo's summary of the target's /metrics
    correctness: Correctness | None = None  # slo's output-correctness summary (None: not checked)
    chunking: Chunking | None = None  # tokens per token-bearing chunk, and what counted them
    sessions: Sessions | None = None  # slo's per-session metrics (None: not a multi-turn run)
    fairness: Fairness | None = None  # tenants' goodput against fair shares (None: no tenants)
    deadlines: Deadlines | None = None  # deadline misses (None: no request had a deadline)
    overload: Overload | None = None  # phases, shedding, recovery (None: no phases, none shed)
    bounds: Bounds | None = None  # lower bounds, Little's law, cost and energy (`slo.bounds`)
    # reasoning models' split (`slo.reasoning`); None: no reasoning, and then no JSON key
    reasoning: Reasoning | None = field(default=None, metadata={_OMIT_WHEN_NONE: True})
    dense: Dense | None = None  # embeddings and rerank runs (`slo.dense`)
    # a cluster's KV handoffs and workers (`slo.disaggregation`); None: unsaid, no JSON key
    disaggregation: Disaggregation | None = field(default=None, metadata={_OMIT_WHEN_NONE: True})
    schema_version: int = CARD_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.headline not in HEADLINES:
            raise ValueError(f"Card.headline must be one of {HEADLINES}, not {self.headline!r}")

    def to_dict(self, *, decimals: int = 4) -> dict:
        """The JSON form: keys in schema order, floats rounded to `decimals` places, NaN and
        infinities as None."""
        data = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        data["goodput"] = goodput_figures(self.goodput)
        for f in fields(self):  # blocks a run without them leaves out, as before they existed
            if f.metadata.get(_OMIT_WHEN_NONE) and data[f.name] is None:
                del data[f.name]
        head = {"schema_version": data.pop("schema_version"), "kind": "run"}
        return round_floats({**head, **data}, decimals)

    def to_json(self) -> str:
        """`to_dict()` as indented JSON text (UTF-8, trailing newline)."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"

    def chunking_sentence(self) -> str | None:
        """One sentence on how TPOT (per token) and ITL (per chunk) relate in this run: the
        tokens each token-bearing chunk carried and what counted them; None without chunks, and
        None where TPOT or ITL is undefined (a non-streamed run's one "chunk" is the whole
        answer, so there are no chunk gaps to relate)."""
        if {"tpot", "itl"} & set(self.undefined_metrics):
            return None
        block = self.chunking or Chunking.empty()
        dist = block.tokens_per_chunk or Distribution.empty()
        mean = dist.mean
        if mean is None:
            return None
        source = block.source
        by = f"; counted by {CHUNK_SOURCE_WORDS.get(source, source)}" if source else ""
        head = (
            f"TPOT is per token, ITL per chunk; chunks carried {mean:.2f} tokens on average "
            f"(p50 {dist.p50:g}, max {dist.max:g}{by})"
        )
        if mean < 1.05:
            return head + ", so the two measure the same steps."
        return (
            head + f", so ITL is about {mean:.1f}x TPOT (speculative decoding or batched writes)."
        )

    def latency_row(self, metric: str) -> LatencyRow | None:
        """The latency row for `metric` (ttft, tpot, itl, e2e), or None."""
        return next((row for row in self.latency if row.metric == metric), None)


CHUNK_SOURCE_WORDS = {
    TokenSource.USAGE.value: "the usage so far in each chunk",
    TokenSource.TOKEN_IDS.value: "each chunk's token ids",
    TokenSource.TOKENIZER.value: "the run's tokenizer on each chunk's text",
    TokenSource.CHUNK_COUNT.value: "one per chunk: the server said neither usage nor token ids",
}


def goodput_figures(goodput: Goodput | None) -> dict | None:
    """The card's goodput: the GOODPUT_FIGURES the summary's block has, in that order; None
    without an SLO."""
    if goodput is None:
        return None
    block = goodput.to_dict()
    return {name: block[name] for name in GOODPUT_FIGURES if name in block}


def _plain(value):
    """A card field as JSON data: a summary section as summary.json has it."""
    if isinstance(value, Section):
        return value.to_dict()
    if is_dataclass(value):
        return asdict(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def round_floats(value, decimals: int):
    """`value` with every float rounded to `decimals` places (NaN/inf -> None), recursively
    through dicts, lists and tuples (tuples become lists)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        rounded = round(value, decimals)
        return 0.0 if rounded == 0 else rounded
    if isinstance(value, dict):
        return {k: round_floats(v, decimals) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [round_floats(v, decimals) for v in value]
    return value
