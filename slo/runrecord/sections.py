"""The run's figures in `summary.json`: counts, rates, latencies, and the checks of the run.

One frozen dataclass per block that `slo.summarize` writes (see `slo.runrecord.section` for
how they read and write); the SLO blocks, slices, faults and conventions are in
`slo.runrecord.slo_sections`. Latencies are in ms, rates per second, "no value" is None; the
`slo` package docstring and each block's writer (named in its docstring) define every figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from slo.runrecord.section import Section, keyed, listed, nested


@dataclass(frozen=True)
class Distribution(Section):
    """`slo.metrics.distribution`: statistics over the defined values (`n` of them); every
    statistic is None with n == 0. `ci` (run latencies only, with bootstrap intervals) maps
    `p50`, `p90`, `p99` to [low, high] or None."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None
    n: int | None = None
    # pooled chunk gaps only (ITL, the conventions that pool gaps): `quantiles` is `exact`, or
    # `sketch` when the percentiles come from a quantile sketch (`slo.sketch`: the gaps were
    # over the run's memory budget); `relative_error` bounds each percentile's (0 when exact)
    quantiles: str | None = None
    relative_error: float | None = None
    ci: dict | None = None

    def interval(self, percentile: int) -> list[float] | None:
        """The [low, high] bootstrap interval of the `percentile`th percentile, or None."""
        pair = (self.ci or {}).get(f"p{percentile}")
        if not isinstance(pair, list | tuple) or len(pair) < 2 or None in pair[:2]:
            return None
        return [float(pair[0]), float(pair[1])]


@dataclass(frozen=True)
class OutcomeCounts(Section):
    """`counts`: requests in all, by status (every sent status, 0 when none) and by error
    class; `not_sent` counts the scheduled requests never dispatched."""

    total: int | None = None
    by_status: dict | None = None
    by_error_class: dict | None = None
    not_sent: int | None = None
    first_message_by_error_class: dict | None = None  # the first error message of each class


@dataclass(frozen=True)
class ThroughputRates(Section):
    """`throughput` (`slo.metrics.throughput`): per second of the window; all None without a
    window. Token rates count the tokens of ok requests."""

    request_per_s: float | None = None  # ok requests
    attempted_request_per_s: float | None = None  # every request
    input_tokens_per_s: float | None = None
    output_tokens_per_s: float | None = None
    total_tokens_per_s: float | None = None


@dataclass(frozen=True)
class Latencies(Section):
    """`latency_ms` (`slo.summary.latency_summary`), over ok requests except `queue` (every
    sent request); a slice's `latency_ms` has ttft, tpot, itl and e2e only."""

    ttft: Distribution | None = nested(Distribution)
    tpot: Distribution | None = nested(Distribution)
    itl: Distribution | None = nested(Distribution)
    e2e: Distribution | None = nested(Distribution)
    itl_request_mean: Distribution | None = nested(Distribution)
    itl_max: Distribution | None = nested(Distribution)
    queue: Distribution | None = nested(Distribution)
    ttft_from_scheduled: Distribution | None = nested(Distribution)


@dataclass(frozen=True)
class DispatchLag(Section):
    """`dispatch_lag_ms` (`slo.summary.dispatch_summary`) over the sent requests."""

    p50: float | None = None
    p99: float | None = None
    max: float | None = None
    n: int | None = None


@dataclass(frozen=True)
class LittleLaw(Section):
    """`little_law` (`slo.consistency.littles_law`): in-flight against arrivals x latency."""

    mean_in_flight: float | None = None
    peak_in_flight: int | None = None
    arrival_rate_per_s: float | None = None
    mean_latency_s: float | None = None
    ratio: float | None = None
    unfinished: int | None = None
    negative_latencies: int | None = None
    consistent: bool | None = None
    window_s: float | None = None


@dataclass(frozen=True)
class Chunking(Section):
    """`chunking` (`slo.summary.chunking_summary`): tokens per token-bearing chunk of ok
    requests, and what counted them (a `TokenSource` value, `mixed`, or None)."""

    tokens_per_chunk: Distribution | None = nested(Distribution)
    source: str | None = None
    source_counts: dict | None = None


@dataclass(frozen=True)
class Saturation(Section):
    """`saturation` (`slo.saturation.judge_saturation`). The quarter figures (from
    `ttft_first_ms` on) are there only once enough requests had a TTFT to compare."""

    judged: bool | None = None
    saturated: bool | None = None
    sentence: str | None = None
    n: int | None = None
    rule: str | None = None
    ttft_first_ms: float | None = None
    ttft_last_ms: float | None = None
    in_flight_first: float | None = None
    in_flight_last: float | None = None
    rho_ttft: float | None = None
    rho_in_flight: float | None = None


@dataclass(frozen=True)
class LeakCheck(Section):
    """The ledger's `leak` (`slo.ledger.leak_check`), from the manifest's `server_state`."""

    checked: bool | None = None
    leaked: bool | None = None
    reasons: list | None = None
    before: dict | None = None
    after: dict | None = None


@dataclass(frozen=True)
class Ledger(Section):
    """`ledger` (`slo.ledger.ledger_summary`): scheduled against recorded requests; `verdict`
    is `ok`, `failed` or `unchecked`."""

    scheduled: int | None = None
    recorded: int | None = None
    lost: int | None = None
    lost_ids: list | None = None
    unexpected: int | None = None
    leaked: int | None = None
    outcomes: dict | None = None
    leak: LeakCheck | None = nested(LeakCheck)
    verdict: str | None = None


@dataclass(frozen=True)
class PromptTokens(Section):
    """`prompt_tokens` (`slo.prompt_tokens.prompt_token_check`): the server's prompt tokens
    against the workload's; `sentence` is the warning for a disagreement."""

    verdict: str | None = None
    n_compared: int | None = None
    n_disagreeing: int | None = None
    ratio: float | None = None
    overhead_tokens: float | None = None
    sentence: str | None = None


@dataclass(frozen=True)
class GaugeStats(Section):
    """One gauge of the target's /metrics over the run."""

    mean: float | None = None
    max: float | None = None
    last: float | None = None


@dataclass(frozen=True)
class ServerMetrics(Section):
    """`server_metrics` (`slo.server_metrics.server_metrics_summary`). Without samples only
    `available` (false), `reason` and `samples` are there. `gauges` and `counters` are keyed
    by the metric's short name (`running`, `kv_cache_usage`, `preemptions`, ...); `series`
    maps a gauge to `[[t_s, value], ...]`."""

    available: bool | None = None
    reason: str | None = None
    samples: int | None = None
    gauges: dict[str, GaugeStats | None] | None = keyed(GaugeStats)
    counters: dict | None = None
    prefix_cache_hit_rate: float | None = None
    spec_decode_acceptance: float | None = None
    spec_decode_mean_accepted_length: float | None = None
    series: dict | None = None


@dataclass(frozen=True)
class LoadRates(Section):
    """One `by_load` row of `correctness`: the compared requests sent at an in-flight count."""

    load: str | None = None
    n: int | None = None
    exact_rate: float | None = None
    wrong_rate: float | None = None

    @property
    def bucket(self) -> str | None:
        return self.load


@dataclass(frozen=True)
class BatchRates(Section):
    """One `by_server_batch` row of `correctness`: the compared requests sent while the
    server ran a batch of this size."""

    batch: str | None = None
    n: int | None = None
    exact_rate: float | None = None
    wrong_rate: float | None = None

    @property
    def bucket(self) -> str | None:
        return self.batch


@dataclass(frozen=True)
class Correctness(Section):
    """`correctness` (`slo.correctness.correctness_summary`): outputs against the reference
    engine; `flags` counts each `OutputFlag`."""

    n_compared: int | None = None
    n_exact: int | None = None
    exact_rate: float | None = None
    agreement_mean: float | None = None
    n_wrong: int | None = None
    diverge_before: int | None = None
    flags: dict | None = None
    by_load: list[LoadRates] | None = listed(LoadRates)
    by_server_batch: list[BatchRates] | None = listed(BatchRates)
    # answers whose tool calls were checked (`tools` offered; ok requests), and their calls
    tool_answers_checked: int | None = None
    tool_calls_made: int | None = None


@dataclass(frozen=True)
class TurnStats(Section):
    """One `by_turn` entry of `sessions`: the requests of one turn index."""

    turn: int | None = None
    n: int | None = None
    ok: int | None = None
    ttft_ms: Distribution | None = nested(Distribution)
    prompt_tokens_mean: float | None = None
    cached_tokens_mean: float | None = None
    cache_hit_rate: float | None = None


@dataclass(frozen=True)
class Sessions(Section):
    """`sessions` (`slo.sessions.sessions_summary`) of a multi-turn run."""

    sessions: int | None = None
    complete: int | None = None
    turns: Distribution | None = nested(Distribution)
    turns_not_sent: int | None = None
    duration_s: Distribution | None = nested(Distribution)
    by_turn: list[TurnStats] | None = listed(TurnStats)
    cache_hit_rate: float | None = None
