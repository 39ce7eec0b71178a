"""`build_card`: a `Card` from one run directory, with every figure taken from `slo`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import slo
from reports import slo_view
from reports.card import (
    LATENCY_METRICS,
    Card,
    ClientHealth,
    Environment,
    Failures,
    LatencyRow,
    Series,
    Throughput,
)
from reports.checks_view import check_notes
from reports.dense_view import OUTPUT_RATES
from reports.errors import ReportError
from reports.memory_view import memory_card
from reports.pooled_view import sketch_notes
from reports.series import (
    CDF_POINTS,
    cdf_points,
    choose_bin_s,
    outcomes_over_time,
    percentiles_over_time,
)
from reports.taxonomy import OutcomeKind, classify_outcomes, count_outcomes
from slo.chunk_digest import read_digest
from slo.frame import RequestMetrics
from slo.runrecord import (
    Distribution,
    LeakCheck,
    RunManifest,
    RunRecordError,
    RunSummary,
    RunTables,
    TokenSource,
    open_run,
)
from slo.runrecord import read_manifest as read_run_manifest
from slo.stats import bootstrap_quantile_ci
from slo.summary import DEFAULT_CLIENT_BOUND_MS, memory_budget_bytes

THROUGHPUT_LABELS = (
    ("request_per_s", "requests/s (finished ok)"),
    ("attempted_request_per_s", "requests/s (attempted)"),
    ("input_tokens_per_s", "input tokens/s (ok requests)"),
    ("output_tokens_per_s", "output tokens/s (ok requests)"),
    ("total_tokens_per_s", "total tokens/s (ok requests)"),
)
MIN_VALUES_FOR_CI = 10
CI_RESAMPLES = 1000


def client_bound_ms(manifest: RunManifest | None) -> float:
    """The dispatch-lag bound the run was recorded with (manifest `config.client_bound_ms`),
    else slo's default."""
    value = (manifest.config if manifest is not None else {}).get("client_bound_ms")
    return float(value) if isinstance(value, int | float) and value > 0 else DEFAULT_CLIENT_BOUND_MS


def read_manifest(run_dir: Path) -> RunManifest:
    """`manifest.json` of `run_dir`; raises ReportError when it is missing, not JSON or of a
    schema version this bench does not read."""
    try:
        return read_run_manifest(run_dir)
    except RunRecordError as exc:
        raise ReportError(str(exc)) from exc


def _capacity_file(run_dir: Path) -> Path | None:
    """`capacity.json` of the run, or of the capacity search directory holding it as a probe."""
    for candidate in (Path(run_dir) / "capacity.json", Path(run_dir).parent / "capacity.json"):
        if candidate.is_file():
            return candidate
    return None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"{path} is not valid JSON ({exc}).") from exc


def read_capacity(run_dir: Path) -> list[dict]:
    """The capacity curve [{rate, attainment, goodput}] of the run's `capacity.json`, or of
    its parent directory's when the run is a probe of a capacity search ([] when neither).

    Accepts a bare list of points, or an object whose `curve_points` or `curve` is one (the
    keys may be `rate`/`rate_per_s` and `goodput`/`goodput_per_s`). Rows are sorted by rate.
    """
    path = _capacity_file(run_dir)
    if path is None:
        return []
    data = _read_json(path)
    if isinstance(data, dict):
        data = data.get("curve_points") or data.get("curve") or []
    rows = []
    for row in data if isinstance(data, list) else []:
        if not isinstance(row, dict):
            continue
        rate = row.get("rate", row.get("rate_per_s"))
        if rate is None:
            continue
        goodput = row.get("goodput", row.get("goodput_per_s"))
        rows.append({"rate": rate, "attainment": row.get("attainment"), "goodput": goodput})
    return sorted(rows, key=lambda row: row["rate"])


def resolve_run_dir(path: Path | str) -> Path:
    """`path` itself when it is a run directory; for a capacity search directory (it holds
    `capacity.json` and probe runs but no manifest), the probe run at the found capacity, else
    its last probe. Raises ReportError when `path` is neither."""
    path = Path(path)
    if (path / "manifest.json").is_file() or not (path / "capacity.json").is_file():
        return path
    record = _read_json(path / "capacity.json")
    probes = [p for p in (record.get("probes") or []) if isinstance(p, dict) and p.get("run_dir")]
    at_capacity = [p for p in probes if p.get("rate_per_s") == record.get("capacity_rate_per_s")]
    for probe in reversed(at_capacity or probes):
        if (path / probe["run_dir"] / "manifest.json").is_file():
            return path / probe["run_dir"]
    raise ReportError(
        f"{path} holds a capacity search but none of its probe runs; pass a run directory."
    )


def worker_rows(section: dict | None) -> tuple[dict, ...]:
    """One row per worker from the manifest's `workers` section: `worker`, `node` (Ray; else
    None), `requests`, `died`, dispatch lag `p50_ms`/`p99_ms`/`max_ms`, and (Ray) the clock
    offset to the parent's clock and its uncertainty in ms."""
    rows = []
    for w in (section or {}).get("per_worker") or []:
        lag = w.get("dispatch_lag_ms") or {}
        offset, uncertainty = w.get("clock_offset_ns"), w.get("clock_uncertainty_ns")
        rows.append(
            {
                "worker": w.get("worker"),
                "node": w.get("node"),
                "requests": w.get("requests"),
                "died": bool(w.get("died")),
                "dispatch_lag_p50_ms": lag.get("p50"),
                "dispatch_lag_p99_ms": lag.get("p99"),
                "dispatch_lag_max_ms": lag.get("max"),
                "clock_offset_ms": None if offset is None else offset / 1e6,
                "clock_uncertainty_ms": None if uncertainty is None else uncertainty / 1e6,
            }
        )
    return tuple(rows)


def _environment(manifest: RunManifest) -> Environment:
    target = manifest.target or {}
    workload = manifest.workload or {}
    versions = dict(manifest.versions or {})
    return Environment(
        engine=target.get("engine"),
        engine_version=target.get("engine_version"),
        model=target.get("model"),
        target_kind=target.get("kind"),
        target_url=target.get("url"),
        hardware=dict(sorted((manifest.hardware or {}).items())),
        harness_version=manifest.harness_version,
        git_sha=manifest.git_sha,
        versions=dict(sorted(versions.items())),
        workload_name=workload.get("name") or workload.get("generator"),
        workload_sha256=workload.get("sha256"),
        workload_synthetic=workload.get("synthetic"),
        command_line=manifest.command_line,
        started_at=manifest.started_at,
        ended_at=manifest.ended_at,
        complete=manifest.complete,
        interrupted_reason=manifest.interrupted_reason,
        dtype=target.get("dtype"),
        quantization=target.get("quantization"),
        kernels=target.get("kernels"),
        kv_cache=kv_cache_text(target.get("engine_config") or {}),
    )


def kv_cache_text(engine_config: dict) -> str | None:
    """How the reference engine stored and kept its KV when not exactly (`--kv-cache-dtype`,
    `--kv-eviction`), from its config in the manifest; None when exact or not said."""
    kv_dtype = engine_config.get("kv_cache_dtype") or "auto"
    eviction = engine_config.get("kv_eviction") or "none"
    if kv_dtype == "auto" and eviction == "none":
        return None
    text = f"KV {kv_dtype}" if kv_dtype != "auto" else "KV exact dtype"
    if eviction != "none":
        sinks = engine_config.get("kv_sink_tokens") if eviction == "sinks" else 0
        text += f", eviction {eviction}: {sinks} sink + {engine_config.get('kv_window_tokens')} window tokens"
    return text


def _ok_values(rm: RequestMetrics, metric: str) -> np.ndarray:
    ok = rm.is_ok
    if metric == "itl":  # a sketch has no values: the summary's interval stands
        pooled = rm.pooled_itl(ok)
        return pooled.values if pooled.is_exact else np.empty(0)
    return getattr(rm, f"{metric}_ms")[ok]


def _interval(dist: Distribution, percentile: int, values: np.ndarray, rng, confidence: float):
    """slo's interval for `percentile` when the summary has one, else slo's bootstrap of it."""
    given = dist.interval(percentile)
    if given is not None or np.count_nonzero(~np.isnan(values)) < MIN_VALUES_FOR_CI:
        return given
    ci = bootstrap_quantile_ci(
        values, float(percentile), rng=rng, confidence=confidence, n_resamples=CI_RESAMPLES
    )
    return None if ci is None else [ci[0], ci[1]]


def _latency_rows(
    summary: RunSummary, rm: RequestMetrics, rng, confidence: float
) -> list[LatencyRow]:
    values = {metric: _ok_values(rm, metric) for metric in LATENCY_METRICS}

    def interval(metric: str, dist: Distribution, percentile: int):
        return _interval(dist, percentile, values[metric], rng, confidence)

    return latency_rows_from_summary(summary, interval=interval)


def latency_rows_from_summary(summary: RunSummary, *, interval=None) -> list[LatencyRow]:
    """Latency rows from a summary. `interval(metric, distribution, 50 | 99)` gives each
    interval; by default only the intervals slo already put in the summary."""
    if interval is None:

        def interval(_metric: str, dist: Distribution, percentile: int):
            return dist.interval(percentile)

    rows = []
    for metric in LATENCY_METRICS:
        dist = getattr(summary.latency_ms, metric) or Distribution.empty()
        rows.append(
            LatencyRow(
                metric=metric,
                n=int(dist.n or 0),
                mean_ms=dist.mean,
                p50_ms=dist.p50,
                p90_ms=dist.p90,
                p95_ms=dist.p95,
                p99_ms=dist.p99,
                max_ms=dist.max,
                p50_ci_ms=interval(metric, dist, 50),
                p99_ci_ms=interval(metric, dist, 99),
            )
        )
    return rows


def throughput_rows(summary: RunSummary) -> list[Throughput]:
    """The labelled rates (THROUGHPUT_LABELS order) that the summary's `throughput` has."""
    rates = summary.throughput.to_dict()
    return [
        Throughput(name=name, label=label, value=rates[name])
        for name, label in THROUGHPUT_LABELS
        if name in rates
    ]


def as_summary(summary: RunSummary | dict) -> RunSummary:
    """`summary` typed: `slo.summarize` returns the dict that summary.json holds."""
    return summary if isinstance(summary, RunSummary) else RunSummary.from_dict(summary)


def _series(tables: RunTables, rm: RequestMetrics, sent_kinds: np.ndarray, run_dir: Path) -> Series:
    """Chart data over the requests that were sent: `rm` leaves `not_sent` rows out (they have
    no time to place them at), so `sent_kinds` is the outcome of each of `rm`'s rows."""
    ok = rm.is_ok
    itl = rm.pooled_itl(ok)
    ends = np.where(np.isnan(rm.t_done_ns), rm.t_sent_ns, rm.t_done_ns)
    span_s = float(np.nanmax(ends)) / 1e9 if np.any(~np.isnan(ends)) else None
    bin_s = choose_bin_s(span_s)
    fault_plan = (tables.manifest.fault_plan if tables.manifest else None) or {}
    windows = [
        {"start_s": w.get("start_s"), "end_s": w.get("end_s"), "kind": w.get("kind")}
        for w in (fault_plan.get("windows") or [])
    ]
    return Series(
        bin_s=bin_s,
        cdf_ms={
            "ttft": cdf_points(rm.ttft_ms[ok]),
            "tpot": cdf_points(rm.tpot_ms[ok]),
            "itl": cdf_points(itl.values) if itl.is_exact else itl.cdf_points(CDF_POINTS),
            "e2e": cdf_points(rm.e2e_ms[ok]),
        },
        over_time={
            "ttft": percentiles_over_time(rm.t_sent_ns[ok], rm.ttft_ms[ok], bin_s),
            "tpot": percentiles_over_time(rm.t_sent_ns[ok], rm.tpot_ms[ok], bin_s),
        },
        failures_over_time=outcomes_over_time(ends, sent_kinds, bin_s),
        fault_windows=windows,
        capacity=read_capacity(run_dir),
    )


def _notes(
    env: Environment, health: ClientHealth, summary: RunSummary, failures: Failures
) -> list[str]:
    notes = []
    if env.complete is False:
        reason = env.interrupted_reason or "no reason recorded"
        notes.append(f"The run is incomplete ({reason}); figures cover what was recorded.")
    if health.client_bound:
        notes.append(
            "The client was the bottleneck (p99 dispatch lag above "
            f"{health.client_bound_threshold_ms} ms): the offered load was lower than asked."
        )
    source = summary.output_tokens_source
    if source in set(TokenSource) and TokenSource(source).counted_by_client:
        how = "by retokenising the output" if source == TokenSource.TOKENIZER else "as chunks"
        notes.append(
            f"Output tokens were counted by the client ({how}); the server reported no usage."
        )
    elif source == "mixed":
        counts = summary.output_tokens_source_counts or {}
        detail = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        notes.append(f"Output tokens come from mixed sources ({detail}).")
    if failures.total == 0:
        notes.append("The run recorded no requests.")
    if summary.saturation is not None and summary.saturation.saturated:
        notes.append(summary.saturation.sentence)
    ledger = summary.ledger
    if ledger is not None and ledger.verdict == "failed":
        leak = " ".join((ledger.leak or LeakCheck.empty()).reasons or [])
        notes.append(
            f"Ledger failed: {ledger.lost} lost, {ledger.unexpected} unexpected, "
            f"{'leak: ' + leak if leak else 'no leak'}."
        )
    return notes


def build_card(
    run_dir: Path | str,
    *,
    slo_spec: dict | None = None,
    summary: RunSummary | dict | None = None,
    rng: np.random.Generator | None = None,
    confidence: float = 0.95,
) -> Card:
    """The report card of the run directory `run_dir` (or of the probe at capacity, for a
    capacity search directory; see `resolve_run_dir`).

    `slo_spec` overrides the SLO recorded in the manifest (None: use the manifest's).
    `summary` is `slo.summarize`'s result for this run (its dict, or the typed `RunSummary`)
    when the caller has it already (it is computed otherwise). `rng` draws the bootstrap resamples of latency intervals that the
    summary lacks (None: a generator seeded with 0, so the same run gives the same card).
    Raises ReportError when the directory is not a readable run directory.
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    run_dir = resolve_run_dir(run_dir)
    manifest = read_manifest(run_dir)
    spec = slo_spec if slo_spec is not None else manifest.slo
    try:
        tables = open_run(run_dir, chunks=False)  # the chunks are read as an order, below
        if summary is None:
            summary = slo.summarize(
                run_dir, spec, client_bound_ms=client_bound_ms(manifest), conventions="all"
            )
        summary = as_summary(summary)
        # the chunks a row batch at a time, gaps exact within the run's memory budget
        chunks = read_digest(run_dir, budget_bytes=memory_budget_bytes(None, manifest))
    except (slo.SLOError, RunRecordError) as exc:
        raise ReportError(str(exc)) from exc
    rm = RequestMetrics.from_tables(tables.requests, chunks)
    del chunks
    kinds = classify_outcomes(tables.requests)
    counts = count_outcomes(kinds)
    failures = Failures(
        total=len(kinds),
        by_error_class=dict(summary.counts.by_error_class or {}),
        first_message_by_error_class=dict(summary.counts.first_message_by_error_class or {}),
        **counts,
    )
    lag = summary.dispatch_lag_ms
    health = ClientHealth(
        dispatch_lag_p50_ms=lag.p50,
        dispatch_lag_p99_ms=lag.p99,
        dispatch_lag_max_ms=lag.max,
        client_bound=summary.client_bound,
        client_bound_threshold_ms=summary.client_bound_threshold_ms,
        workers=worker_rows(manifest.workers),
        workers_clock=(manifest.workers or {}).get("clock"),
    )
    env = _environment(manifest)
    verdicts = slo_view.verdicts(summary)
    return Card(
        run_id=str(manifest.run_id or run_dir.name),
        headline=slo_view.headline(summary, verdicts, has_slo=slo_view.has_slo(summary, spec)),
        slo_name=slo_view.slo_name(summary, spec),
        slo_verdicts=verdicts,
        goodput=summary.goodput,
        throughput=[t for t in throughput_rows(summary) if not _is_output_rate(summary, t)],
        latency=[  # a latency with no value (not streamed, no tokens) gets a sentence, no row
            row
            for row in _latency_rows(summary, rm, rng, confidence)
            if row.metric not in (summary.undefined_metrics or {})
        ],
        slices=slo_view.slices(summary),
        failures=failures,
        memory=memory_card(summary.memory),
        client_health=health,
        environment=env,
        series=_series(tables, rm, kinds[kinds != OutcomeKind.NOT_SENT.value], run_dir),
        window_s=summary.window_s,
        output_tokens_source=summary.output_tokens_source,
        notes=[
            *check_notes(summary, manifest),
            *_notes(env, health, summary, failures),
            *sketch_notes(summary),
        ],
        ledger=summary.ledger,
        faults=list((summary.faults.windows if summary.faults is not None else None) or []),
        conventions=summary.conventions,
        undefined_metrics=dict(summary.undefined_metrics or {}),
        saturation=summary.saturation,
        server_metrics=summary.server_metrics,
        correctness=summary.correctness,
        chunking=summary.chunking,
        sessions=summary.sessions,
        overload=summary.overload,
        bounds=summary.bounds,
        reasoning=summary.reasoning,
        fairness=summary.fairness,
        deadlines=summary.deadlines,
        dense=summary.dense,
        disaggregation=summary.disaggregation,
    )


def _is_output_rate(summary: RunSummary, rate: Throughput) -> bool:
    """An output-token rate of a run that generates no tokens (embeddings, rerank)."""
    return summary.dense is not None and rate.name in OUTPUT_RATES
