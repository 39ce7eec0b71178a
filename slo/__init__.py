"""slo: metric definitions, SLO specs and verdicts, goodput, capacity search.

Entry point: `summarize(run_dir, slo_spec=None) -> dict`, the content of `summary.json`
(`slo.runrecord.RunSummary` is its typed, versioned form: `RunSummary.from_dict(summary)` reads
each block below as a section of `slo.runrecord`, its keys as attributes; readers use those,
never the key strings). The run-directory contract itself is `slo.runrecord`.
All fields of that dict (latencies in ms, rates per second, None where undefined):

- `schema_version` (1), `definitions` (name -> one-line definition of each metric).
- `counts`: `{total, by_status: {ok, error, timeout, cancelled, rejected, unknown},
  by_error_class: {class: n}}`; `error_rate`: not-ok / all.
- `window_s`: first send to last done; `throughput`: `request_per_s` (ok requests),
  `attempted_request_per_s` (all), `input_tokens_per_s`, `output_tokens_per_s`,
  `total_tokens_per_s` (tokens of ok requests).
- `latency_ms`: `ttft`, `tpot` (per token), `itl` (per chunk: pooled chunk gaps), `e2e`, `itl_request_mean`,
  `itl_max` (longest stall per request), each `{mean, p50, p90, p95, p99, max, n}` over
  ok requests (linear-interpolated percentiles); ttft, tpot, itl and e2e add
  `ci: {p50, p90, p99}` -> [low, high] seeded bootstrap intervals (None under two values)
  at `ci_confidence` (0.95). `itl` (and every pooled figure of chunk gaps: slices, the
  conventions, an `itl_ms` objective) adds `quantiles` (`exact`, or `sketch` beyond the
  run's memory budget: `slo.sketch`) and `relative_error` (0, or the sketch's 0.01).
- `dispatch_lag_ms`: `{p50, p99, max, n}`; `client_bound` (p99 lag > bound) and
  `client_bound_threshold_ms`.
- `output_tokens_source` (a `slo.runrecord.TokenSource` value: `usage`, `token_ids`,
  `tokenizer` or `chunk_count`; `mixed`; or None) and `output_tokens_source_counts`;
  `run_complete` (manifest `complete`) and `run_stop_reason` (its `interrupted_reason`: a
  stop rule, Ctrl-C, a managed server that died).
- `chunking`: tokens per token-bearing chunk and what counted them, the link between TPOT
  and ITL under speculative decoding; see `slo.summary.chunking_summary`.
- `little_law`: see `slo.consistency.littles_law`.
- `overload`: None, or a run with load phases (staged arrivals) or shed requests cut into its
  phases: shedding, latency and Little's law per phase, and the recovery time after the peak;
  see `slo.overload` (phases: `slo.load_phases`; per phase: `slo.littles_law`).
- `memory`: memory per request as the target reported it (`usage.kv_memory`: peak,
  token-weighted mean, amortised over sharers, unused slots, temporaries; lossily evicted
  requests counted) or estimated from its KV cache gauge and running count; see `slo.memory`.
- `bounds`: the seed's lower bounds beside what the run measured, each with its formula, the
  ratio measured / bound and why they can differ: KV bytes per request and of the peak
  in-flight set, Little's law per load phase, the P/D transfer time (absent); with the cost per
  million output tokens at the SLO (`--cost-per-hour`) and joules per output token; see
  `slo.bounds` and `slo.cost`.
- `slices`: `{input_tokens, output_tokens, in_flight[, time]}` lists, see `slo.slices.slices_summary`;
  `tenant` and `priority` when the requests have them (`slo.classes.class_slices`).
- `fairness`, `deadlines`: None, or Jain's index over the tenants' goodput against max-min
  fair shares, and the deadline misses by kind; see `slo.classes`.
- `reasoning`: None without reasoning tokens, else the time to the first reasoning and to the
  first answer token, TPOT and tokens of each part, and which TTFT the SLO judged; see
  `slo.reasoning`.
- `disaggregation`: None unless requests carried a cluster's KV-handoff figures or serving
  worker; else handoffs ok, failed and retried, prefill, transfer and install times, bytes per
  handoff, the effective link bandwidth sum(bytes) / sum(transfer_ms) and requests per worker;
  see `slo.disaggregation`.
- `slo`: None, or `{spec, verdict, objectives}` (see `slo.verdicts.evaluate`); `ttft` on the block
  and on each objective that reads TTFT when the run had reasoning or the spec asks for the
  first answer token (`slo.reasoning.mark_ttft`).
- `goodput`: None, or see `slo.goodput.goodput_summary`.
- `conventions` (only with `conventions="all"`): see `slo.conventions`.
- `sessions`: None, or per-session metrics of a multi-turn run (duration, TTFT by turn index,
  prefix-cache hit rate): see `slo.sessions.sessions_summary`.
"""

from slo import capacity, metrics
from slo.errors import SLOError
from slo.spec import (
    PercentileObjective,
    PerRequestObjectives,
    SliceOverride,
    SLOSpec,
    builtin_names,
    load_slo,
)
from slo.summary import summarize, summarize_tables

__all__ = [
    "PerRequestObjectives",
    "PercentileObjective",
    "SLOError",
    "SLOSpec",
    "SliceOverride",
    "builtin_names",
    "capacity",
    "load_slo",
    "metrics",
    "summarize",
    "summarize_tables",
]
