"""`summarize`: the summary dict that `summary.json` holds (see the `slo` package docstring)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from slo import metrics
from slo.frame import RequestMetrics
from slo.run_tables import RunTables, load_run

SUMMARY_SCHEMA_VERSION = 1
DEFAULT_CLIENT_BOUND_MS = 10.0

DEFINITIONS = {
    "ttft": "send to first token-bearing chunk, per ok request (ms)",
    "tpot": "(t_last_token - t_first_token) / (output_tokens - 1), per ok request with >= 2 "
    "output tokens (ms)",
    "itl": "gaps between consecutive token-bearing chunks of ok requests, pooled (ms)",
    "itl_request_mean": "mean chunk gap per ok request (ms)",
    "itl_max": "longest chunk gap (stall) per ok request (ms)",
    "e2e": "send to done, per ok request (ms)",
    "window": "first send to last done over all requests (s)",
    "throughput": "ok requests, and input/output tokens of ok requests, per second of window; "
    "attempted_request_per_s counts every request",
    "percentiles": "linear interpolation between order statistics (numpy default, as vLLM)",
    "dispatch_lag": "t_sent - t_scheduled over all sent requests (ms)",
    "error_rate": "requests not ok / all requests",
}


def latency_summary(rm: RequestMetrics) -> dict:
    """The `latency_ms` block over the ok requests of `rm`: one `distribution` per metric."""
    ok = rm.is_ok
    return {
        "ttft": metrics.distribution(rm.ttft_ms[ok]),
        "tpot": metrics.distribution(rm.tpot_ms[ok]),
        "itl": metrics.distribution(rm.pooled_itl_ms(ok)),
        "e2e": metrics.distribution(rm.e2e_ms[ok]),
        "itl_request_mean": metrics.distribution(rm.itl_mean_ms[ok]),
        "itl_max": metrics.distribution(rm.itl_max_ms[ok]),
    }


def throughput_summary(rm: RequestMetrics, window_s: float | None) -> dict:
    """The `throughput` block: `metrics.throughput` over `window_s` for the requests of `rm`."""
    ok = rm.is_ok
    return metrics.throughput(
        window_s=window_s,
        num_ok=int(ok.sum()),
        num_requests=len(rm),
        ok_input_tokens=float(np.nansum(rm.input_tokens[ok])),
        ok_output_tokens=float(np.nansum(rm.output_tokens[ok])),
    )


def error_rate(rm: RequestMetrics) -> float | None:
    """Fraction of requests whose status is not `ok`; None with no requests."""
    return float((~rm.is_ok).mean()) if len(rm) else None


def output_tokens_source(rm: RequestMetrics) -> tuple[str | None, dict]:
    """(`usage` | `client_count` | `mixed` | None, counts per source) over all requests."""
    sources: dict[str, int] = {}
    for s in rm.output_tokens_source:
        if s is not None:
            sources[s] = sources.get(s, 0) + 1
    if not sources:
        return None, {}
    label = next(iter(sources)) if len(sources) == 1 else "mixed"
    return label, dict(sorted(sources.items()))


def dispatch_summary(rm: RequestMetrics, client_bound_ms: float) -> tuple[dict, bool]:
    """(`{p50, p99, max, n}` of dispatch lag in ms, client_bound) over all sent requests.

    `client_bound` is true when the p99 lag exceeds `client_bound_ms`: the load generator
    could not keep to the schedule, so the offered load was lower than asked.
    """
    dist = metrics.distribution(metrics.dispatch_lag_ms(rm.t_scheduled_ns, rm.t_sent_ns))
    lag = {"p50": dist["p50"], "p99": dist["p99"], "max": dist["max"], "n": dist["n"]}
    return lag, bool(lag["p99"] is not None and lag["p99"] > client_bound_ms)


def core_summary(rm: RequestMetrics, *, client_bound_ms: float = DEFAULT_CLIENT_BOUND_MS) -> dict:
    """Counts, window, throughput, latencies, dispatch lag and token source for `rm`."""
    window_s = rm.window_s()
    lag, client_bound = dispatch_summary(rm, client_bound_ms)
    source, source_counts = output_tokens_source(rm)
    return {
        "counts": metrics.outcome_counts(rm.status, rm.error_class),
        "error_rate": error_rate(rm),
        "window_s": window_s,
        "throughput": throughput_summary(rm, window_s),
        "latency_ms": latency_summary(rm),
        "dispatch_lag_ms": lag,
        "client_bound": client_bound,
        "client_bound_threshold_ms": client_bound_ms,
        "output_tokens_source": source,
        "output_tokens_source_counts": source_counts,
    }


def summarize_tables(
    tables: RunTables,
    slo_spec: dict | None = None,
    *,
    client_bound_ms: float = DEFAULT_CLIENT_BOUND_MS,
) -> dict:
    """`summarize` over tables already in memory (the harness may call this before writing)."""
    rm = RequestMetrics.from_tables(tables.requests, tables.chunks)
    summary = {"schema_version": SUMMARY_SCHEMA_VERSION, "definitions": DEFINITIONS}
    summary.update(core_summary(rm, client_bound_ms=client_bound_ms))
    summary["run_complete"] = tables.manifest.get("complete")
    return summary


def summarize(
    run_dir: Path | str,
    slo_spec: dict | None = None,
    *,
    client_bound_ms: float = DEFAULT_CLIENT_BOUND_MS,
) -> dict:
    """Read the run directory `run_dir` and return its JSON-serialisable summary dict.

    Raises `SLOError` when the directory has no readable `requests.parquet`.
    """
    return summarize_tables(load_run(run_dir), slo_spec, client_bound_ms=client_bound_ms)
