"""`summarize`: the summary dict that `summary.json` holds (see the `slo` package docstring)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from slo import metrics
from slo.bounds import KVGeometry, bounds_summary
from slo.chunk_digest import CONTENT, THROUGH_LAST_TOKEN, ChunkDigest, digest_chunks, read_digest
from slo.classes import ClassColumns, class_slices, deadlines_summary, fairness_summary
from slo.consistency import littles_law
from slo.conventions import conventions_summary
from slo.correctness import correctness_summary
from slo.dense import DENSE_UNDEFINED, dense_endpoint, dense_summary
from slo.disaggregation import disaggregation_summary
from slo.errors import SLOError
from slo.frame import RequestMetrics, attempted_requests, not_sent_count
from slo.goodput import goodput_summary
from slo.ledger import ledger_summary
from slo.memory import memory_summary
from slo.overload import overload_summary
from slo.prompt_tokens import prompt_token_check
from slo.reasoning import mark_ttft, reasoning_summary, slo_request_metrics
from slo.recovery import recovery_summary
from slo.runrecord import (
    SUMMARY_SCHEMA_VERSION,
    Endpoint,
    RequestColumn,
    RequestStatus,
    RunManifest,
    RunRecordError,
    RunTables,
    float_column,
    open_run,
    release_free_memory,
)
from slo.saturation import saturation_summary
from slo.server_metrics import server_metrics_summary
from slo.sessions import sessions_summary
from slo.slices import DEFAULT_INPUT_EDGES, DEFAULT_OUTPUT_EDGES, slices_summary
from slo.spec import SLOSpec, as_spec
from slo.stats import bootstrap_quantile_ci
from slo.verdicts import evaluate

DEFAULT_CLIENT_BOUND_MS = 10.0
# What the summary and the card of a run may hold of its chunks (`slo.sketch`): pooled gaps
# are exact while they fit, a sketch beyond; `bench run --memory-budget-mb` records another.
DEFAULT_MEMORY_BUDGET_MB = 512.0
DEFAULT_CI_CONFIDENCE = 0.95

DEFINITIONS = {
    "ttft": "send to first token-bearing chunk, per ok request (ms)",
    "tpot": "per token: (t_last_token - t_first_token) / (output_tokens - 1), per ok request "
    "with >= 2 output tokens (ms); the same however many tokens each chunk carries",
    "itl": "per chunk: gaps between consecutive token-bearing chunks of ok requests, pooled "
    "(ms); a chunk carrying k tokens (speculative decoding, batched writes) is one gap, so "
    "ITL is about k x TPOT where chunks carry k tokens",
    "tokens_per_chunk": "tokens per token-bearing chunk of ok requests, counted from the tokens "
    "(`chunk_tokens_source`: the usage so far in each chunk, its token ids, or the run's "
    "tokenizer on its text; one per chunk only when none of these is there)",
    "itl_request_mean": "mean chunk gap per ok request (ms)",
    "itl_max": "longest chunk gap (stall) per ok request (ms)",
    "e2e": "send to done, per ok request (ms)",
    "window": "first send to last done over all requests (s)",
    "throughput": "ok requests, and input/output tokens of ok requests, per second of window; "
    "attempted_request_per_s counts every request",
    "percentiles": "linear interpolation between order statistics (numpy default, as vLLM)",
    "dispatch_lag": "t_sent - max(t_scheduled, t_slot_freed) over all sent requests (ms): how "
    "late the load generator sent each request once it was free to go (its scheduled time, or "
    "when a slot of the concurrency cap freed for it, whichever is later); waiting for the cap "
    "is client queueing (`queue`), not lag",
    "queue": "client queueing time: t_sent - t_scheduled over all sent requests (ms); time a "
    "request waited in the client (behind a concurrency cap, or a late dispatcher) before "
    "TTFT and E2E start counting",
    "ttft_from_scheduled": "t_first_token - t_scheduled, per ok request (ms): TTFT as the "
    "waiting user saw it, client queueing included (MLPerf loadgen's TTFT)",
    "error_rate": "requests not ok / all requests",
}


CI_PERCENTILES = (50, 90, 99)
CI_METRICS = ("ttft", "tpot", "itl", "e2e")


def latency_summary(
    rm: RequestMetrics,
    *,
    rng: np.random.Generator | None = None,
    ci_confidence: float = DEFAULT_CI_CONFIDENCE,
) -> dict:
    """The `latency_ms` block over the ok requests of `rm`: one `distribution` per metric
    (`queue`, the client queueing time, is over every sent request).

    With `rng`, the ttft, tpot, itl and e2e blocks also get `ci`: `{p50, p90, p99}` ->
    [low, high] seeded bootstrap intervals at `ci_confidence` (None with fewer than two
    values).
    """
    ok = rm.is_ok
    itl = rm.pooled_itl(ok)  # exact, or a sketch beyond the memory budget
    values = {
        "ttft": rm.ttft_ms[ok],
        "tpot": rm.tpot_ms[ok],
        "itl": itl,
        "e2e": rm.e2e_ms[ok],
        "itl_request_mean": rm.itl_mean_ms[ok],
        "itl_max": rm.itl_max_ms[ok],
        "queue": metrics.dispatch_lag_ms(rm.t_scheduled_ns, rm.t_sent_ns),
        "ttft_from_scheduled": metrics.ttft_ms(rm.t_scheduled_ns[ok], rm.t_first_token_ns[ok]),
    }
    out = {
        name: metrics.pooled_distribution(v) if v is itl else metrics.distribution(v)
        for name, v in values.items()
    }
    if rng is not None:
        for name in CI_METRICS:
            if name == "itl":
                out[name]["ci"] = {
                    f"p{q}": itl.interval(q, rng=rng, confidence=ci_confidence)
                    for q in CI_PERCENTILES
                }
                continue
            defined = values[name][~np.isnan(values[name])]
            out[name]["ci"] = {
                f"p{q}": _interval(defined, q, rng, ci_confidence) for q in CI_PERCENTILES
            }
    return out


def _interval(values: np.ndarray, q: float, rng: np.random.Generator, confidence: float):
    if values.size < 2:
        return None
    low, high = bootstrap_quantile_ci(values, q, rng=rng, confidence=confidence)
    return [low, high]


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


def first_messages(rm: RequestMetrics) -> dict[str, str]:
    """The error message of the first request (by end time) of each error class."""
    order = np.argsort(np.where(np.isnan(rm.t_done_ns), np.inf, rm.t_done_ns), kind="stable")
    first: dict[str, str] = {}
    for i in order:
        name, message = rm.error_class[i], rm.error_message[i]
        if name is not None and name not in first:
            first[name] = message or ""
    return dict(sorted(first.items()))


def error_rate(rm: RequestMetrics) -> float | None:
    """Fraction of requests whose status is not `ok`; None with no requests."""
    return float((~rm.is_ok).mean()) if len(rm) else None


def output_tokens_source(rm: RequestMetrics) -> tuple[str | None, dict]:
    """(a `TokenSource` value | `mixed` | None, counts per source) over the requests with
    output (`output_tokens` above 0). A request rejected or failed before any output still
    names the client's count of nothing (`chunk_count`); it says nothing of how the run
    counted tokens, so it makes no run `mixed`."""
    sources: dict[str, int] = {}
    with_output = rm.output_tokens > 0  # NaN (no count) is not output
    for s in rm.output_tokens_source[with_output]:
        if s is not None:
            sources[s] = sources.get(s, 0) + 1
    if not sources:
        return None, {}
    label = next(iter(sources)) if len(sources) == 1 else "mixed"
    return label, dict(sorted(sources.items()))


def dispatch_summary(
    rm: RequestMetrics, client_bound_ms: float, t_slot_freed_ns: np.ndarray | None = None
) -> tuple[dict, bool]:
    """(`{p50, p99, max, n}` of dispatch lag in ms, client_bound) over all sent requests.

    A request's lag runs from when it was free to go, the later of its scheduled time and
    `t_slot_freed_ns` (when the concurrency-cap slot it took was freed, ns relative to t0,
    aligned with `rm`; NaN or None: no cap, or a slot free from the start), to when it was
    sent: a cap holding requests back is the load the run asked for, not a late load
    generator.
    `client_bound` is true when the p99 lag exceeds `client_bound_ms`: the load generator
    could not keep to the schedule, so the offered load was lower than asked.
    """
    lag_ms = metrics.dispatch_lag_ms(rm.t_scheduled_ns, rm.t_sent_ns, t_slot_freed_ns)
    dist = metrics.distribution(lag_ms)
    lag = {"p50": dist["p50"], "p99": dist["p99"], "max": dist["max"], "n": dist["n"]}
    return lag, bool(lag["p99"] is not None and lag["p99"] > client_bound_ms)


def core_summary(
    rm: RequestMetrics,
    *,
    client_bound_ms: float = DEFAULT_CLIENT_BOUND_MS,
    rng: np.random.Generator | None = None,
    ci_confidence: float = DEFAULT_CI_CONFIDENCE,
    t_slot_freed_ns: np.ndarray | None = None,
) -> dict:
    """Counts, window, throughput, latencies, dispatch lag and token source for `rm`.

    `rng` (optional) adds bootstrap intervals to the latency blocks; see `latency_summary`.
    `t_slot_freed_ns` (aligned with `rm`) is what `dispatch_summary` takes.
    """
    window_s = rm.window_s()
    lag, client_bound = dispatch_summary(rm, client_bound_ms, t_slot_freed_ns)
    source, source_counts = output_tokens_source(rm)
    return {
        "counts": metrics.outcome_counts(rm.status, rm.error_class),
        "error_rate": error_rate(rm),
        "window_s": window_s,
        "throughput": throughput_summary(rm, window_s),
        "latency_ms": latency_summary(rm, rng=rng, ci_confidence=ci_confidence),
        "dispatch_lag_ms": lag,
        "client_bound": client_bound,
        "client_bound_threshold_ms": client_bound_ms,
        "output_tokens_source": source,
        "output_tokens_source_counts": source_counts,
    }


def chunking_summary(
    requests: pa.Table, chunks: pa.Table | metrics.ChunkOrder | ChunkDigest, rm: RequestMetrics
) -> dict:
    """`{tokens_per_chunk: distribution, source, source_counts}` over the token-bearing chunks
    of ok requests: how many tokens each streamed chunk carried (1.0 everywhere without
    speculative decoding or batched writes), and what counted them (`TokenSource` values per
    request; `mixed` when they differ, None when no request had a token-bearing chunk)."""
    ok_ids = pa.array(np.asarray(rm.request_id, dtype=object)[rm.is_ok].tolist(), pa.string())
    if not isinstance(chunks, ChunkDigest) or chunks.ok_tokens is None:
        chunks = digest_chunks(chunks, ok_ids=set(ok_ids.to_pylist()))
    counts: dict[str, int] = {}
    if RequestColumn.CHUNK_TOKENS_SOURCE.value in requests.column_names:  # older runs lack it
        ok_rows = requests.filter(pc.is_in(requests[RequestColumn.REQUEST_ID], value_set=ok_ids))
        for source in ok_rows[RequestColumn.CHUNK_TOKENS_SOURCE].to_pylist():
            if source is not None:
                counts[source] = counts.get(source, 0) + 1
    label = (next(iter(counts)) if len(counts) == 1 else "mixed") if counts else None
    return {
        "tokens_per_chunk": metrics.counts_distribution(chunks.ok_tokens),
        "source": label,
        "source_counts": dict(sorted(counts.items())),
    }


def _resolve_spec(slo_spec, manifest: RunManifest | None) -> SLOSpec | None:
    if slo_spec is not None:
        return as_spec(slo_spec)
    recorded = manifest.slo if manifest is not None else None
    return as_spec(recorded) if isinstance(recorded, dict) else None


def summarize_tables(
    tables: RunTables,
    slo_spec: SLOSpec | dict | str | None = None,
    *,
    seed: int = 0,
    conventions: str | None = None,
    client_bound_ms: float = DEFAULT_CLIENT_BOUND_MS,
    input_edges: tuple[float, ...] = DEFAULT_INPUT_EDGES,
    output_edges: tuple[float, ...] = DEFAULT_OUTPUT_EDGES,
    slice_duration_s: float | None = None,
    chunk_order: metrics.ChunkOrder | None = None,
    digest: ChunkDigest | None = None,
) -> dict:
    """`summarize` over tables already in memory; same arguments and result (every pooled
    figure exact). `chunk_order`, when given, stands for `tables.chunks` (already ordered);
    `digest` (`summarize` reads one a batch at a time) for both."""
    if conventions not in (None, "all"):
        raise SLOError(f"conventions must be 'all' or omitted, not {conventions!r}.")
    spec = _resolve_spec(slo_spec, tables.manifest)
    if digest is None:  # one pass over the chunks for every block
        order = chunk_order if chunk_order is not None else tables.chunks
        digest = digest_chunks(order, **digest_options(tables, spec, conventions))
    chunks = digest
    rm = RequestMetrics.from_tables(tables.requests, chunks)
    summary = {"schema_version": SUMMARY_SCHEMA_VERSION, "definitions": DEFINITIONS}
    ci_rng, slo_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    # the same rows as `rm`: the sent requests, in table order
    slot_freed = float_column(attempted_requests(tables.requests), RequestColumn.T_SLOT_FREED_NS)
    summary.update(
        core_summary(rm, client_bound_ms=client_bound_ms, rng=ci_rng, t_slot_freed_ns=slot_freed)
    )
    summary["counts"]["not_sent"] = not_sent_count(tables.requests)
    summary["counts"]["first_message_by_error_class"] = first_messages(rm)
    summary["ci_confidence"] = DEFAULT_CI_CONFIDENCE
    summary["run_complete"] = tables.manifest.complete if tables.manifest else None
    summary["run_stop_reason"] = tables.manifest.interrupted_reason if tables.manifest else None
    summary["served_by"] = engine_path(tables.manifest)
    summary["little_law"] = littles_law(rm.t_sent_ns, rm.t_done_ns)
    if slice_duration_s is None and tables.manifest is not None:
        slice_duration_s = (tables.manifest.config or {}).get("slice_duration_s")
    # every block that judges requests against the SLO reads the TTFT the spec names
    slo_rm = slo_request_metrics(rm, tables.requests, spec) if spec is not None else rm
    summary["slices"] = slices_summary(
        slo_rm,
        spec,
        input_edges=input_edges,
        output_edges=output_edges,
        slice_duration_s=slice_duration_s,
    )
    classes = ClassColumns.of(tables.requests)
    summary["slices"].update(class_slices(classes, slo_rm, spec))
    summary["fairness"] = fairness_summary(classes, slo_rm, spec)
    summary["deadlines"] = deadlines_summary(classes, rm)
    summary["ledger"] = ledger_summary(tables)
    summary["saturation"] = saturation_summary(rm)
    summary["sessions"] = sessions_summary(tables.requests)
    workload = tables.manifest.workload if tables.manifest else None
    overload = overload_summary(rm, workload)
    summary["overload"] = overload.to_dict() if overload is not None else None
    summary["memory"] = memory_summary(tables)
    fault_plan = (tables.manifest.fault_plan if tables.manifest else None) or {}
    summary["faults"] = (
        {
            "plan": fault_plan.get("name"),
            "sha256": fault_plan.get("sha256"),
            "windows": recovery_summary(slo_rm, fault_plan.get("windows") or [], spec=spec),
        }
        if fault_plan
        else None
    )
    summary.update(checks_summary(tables))
    summary["chunking"] = chunking_summary(tables.requests, chunks, rm)
    summary["slo"] = None
    summary["goodput"] = None
    reasoning = reasoning_summary(tables.requests, spec)
    summary["reasoning"] = reasoning
    if spec is not None:
        summary["slo"] = evaluate(slo_rm, spec, rng=slo_rng)
        mark_ttft(summary["slo"], spec, reasoning=reasoning is not None)
        summary["goodput"] = goodput_summary(slo_rm, spec, summary["window_s"])
    streamed = is_streamed(tables.manifest)
    summary["streamed"] = streamed
    summary["bounds"] = bounds_summary(tables, rm, chunks.token_rows, spec, streamed=streamed)
    summary["dense"] = dense_summary(attempted_requests(tables.requests), rm, tables.manifest)
    summary["disaggregation"] = disaggregation_summary(tables.requests)
    undefined = NON_STREAMING_UNDEFINED if summary["dense"] is None else DENSE_UNDEFINED
    summary["undefined_metrics"] = {} if streamed else dict(undefined)
    if conventions == "all":
        target = tables.manifest.target if tables.manifest else {}
        chat = Endpoint.CHAT.value in str(target.get("endpoint") or "")
        endpoint = Endpoint.CHAT if chat else Endpoint.COMPLETIONS
        summary["conventions"] = (
            conventions_summary(rm, chunks, endpoint)
            if streamed
            else {"undefined": NON_STREAMING_UNDEFINED["ttft"]}
        )
    return summary


# Why each latency has no value in a non-streaming run (the response arrives whole).
NON_STREAMING_UNDEFINED = {
    name: "undefined: the run was not streamed, so no token was seen before the whole "
    "response arrived (E2E is defined)"
    for name in ("ttft", "tpot", "itl", "itl_request_mean", "itl_max", "ttft_from_scheduled")
}


ENGINE_PATH_KEYS = ("engine", "engine_version", "dtype", "dtype_choice", "quantization", "kernels")


def engine_path(manifest: RunManifest | None) -> dict | None:
    """What served the run, as the manifest's target recorded it (`ENGINE_PATH_KEYS`, the
    ones it has); None without a manifest or when the target recorded none of them."""
    target = (manifest.target if manifest is not None else None) or {}
    path = {key: target[key] for key in ENGINE_PATH_KEYS if target.get(key) is not None}
    return path or None


def is_streamed(manifest: RunManifest | None) -> bool:
    """Whether the run asked for streamed responses (`config.stream`; runs that predate the
    field were streamed); embeddings and rerank runs never are."""
    config = (manifest.config if manifest is not None else None) or {}
    return bool(config.get("stream", True)) and dense_endpoint(manifest) is None


def checks_summary(tables: RunTables) -> dict:
    """The `prompt_tokens`, `server_metrics` and `correctness` blocks of a run's summary.

    The chat template's constant overhead comes from the manifest's
    `target.prompt_overhead_tokens` (0 when absent), the divergence position from
    `config.diverge_before`."""
    manifest = tables.manifest
    target = (manifest.target if manifest else None) or {}
    config = (manifest.config if manifest else None) or {}
    requests = tables.requests
    # a session's later turns carry its history, so their prompts are not the workload's alone
    first = ~(float_column(requests, RequestColumn.TURN_INDEX) > 0)
    return {
        "prompt_tokens": prompt_token_check(
            float_column(requests, RequestColumn.INPUT_TOKENS)[first],
            float_column(requests, RequestColumn.USAGE_PROMPT_TOKENS)[first],
            overhead_tokens=float(target.get("prompt_overhead_tokens") or 0),
        ),
        "server_metrics": server_metrics_summary(tables.server_metrics),
        "correctness": correctness_summary(
            requests,
            diverge_before=config.get("diverge_before"),
            server_metrics=tables.server_metrics,
        ),
    }


def digest_options(tables: RunTables, spec: SLOSpec | None, conventions: str | None) -> dict:
    """What the summary asks of the chunks' pass (`slo.chunk_digest`): the gap pools its
    conventions read, the ok requests (tokens per chunk), the ITL limits the SLO counts gaps
    over, and the token-bearing rows when the peak in-flight KV bound needs them."""
    requests = attempted_requests(tables.requests)
    ok_ids: set[str] = set()
    if requests.num_rows:  # the ok rows' ids alone as Python strings, not every row's
        ok = pc.fill_null(pc.equal(requests[RequestColumn.STATUS], RequestStatus.OK.value), False)
        ok_ids = set(requests[RequestColumn.REQUEST_ID].filter(ok).to_pylist())
    target = (tables.manifest.target if tables.manifest else None) or {}
    kinds = (CONTENT,)
    if conventions == "all" and Endpoint.CHAT.value in str(target.get("endpoint") or ""):
        kinds += (THROUGH_LAST_TOKEN,)
    thresholds = tuple(p.max_ms for p in (spec.percentiles if spec else ()) if p.metric == "itl_ms")
    return {
        "kinds": kinds,
        "ok_ids": ok_ids,
        "thresholds": thresholds,
        "keep_token_rows": KVGeometry.of(target)[0] is not None and is_streamed(tables.manifest),
    }


def memory_budget_bytes(memory_budget_mb: float | None, manifest: RunManifest | None) -> float:
    """The budget in bytes: `memory_budget_mb`, else the run's (`config.memory_budget_mb`),
    else `DEFAULT_MEMORY_BUDGET_MB`."""
    if memory_budget_mb is None:
        recorded = ((manifest.config if manifest else None) or {}).get("memory_budget_mb")
        ok = isinstance(recorded, int | float) and not isinstance(recorded, bool) and recorded > 0
        memory_budget_mb = recorded if ok else DEFAULT_MEMORY_BUDGET_MB
    if not memory_budget_mb > 0:
        raise SLOError(f"the memory budget must be above 0 MB, not {memory_budget_mb!r}.")
    return float(memory_budget_mb) * 2**20


def summarize(
    run_dir: Path | str,
    slo_spec: SLOSpec | dict | str | None = None,
    *,
    seed: int = 0,
    conventions: str | None = None,
    client_bound_ms: float = DEFAULT_CLIENT_BOUND_MS,
    input_edges: tuple[float, ...] = DEFAULT_INPUT_EDGES,
    output_edges: tuple[float, ...] = DEFAULT_OUTPUT_EDGES,
    slice_duration_s: float | None = None,
    memory_budget_mb: float | None = None,
) -> dict:
    """Read the run directory `run_dir` and return its JSON-serialisable summary dict.

    `slo_spec`: an `SLOSpec`, its dict form, or a name/path for `load_slo`; None uses the
    spec recorded in manifest.json (`slo`), if any. `seed` seeds the bootstrap intervals.
    `conventions="all"` adds other tools' TPOT/ITL definitions. `client_bound_ms` is the
    p99 dispatch-lag bound. The edges shape the length slices; `slice_duration_s` (s) adds
    fixed-width time slices of the dispatch period. Raises `SLOError`
    for a missing or unreadable run directory and for a bad SLO spec. The latency blocks
    carry seeded bootstrap intervals (`ci`) at 95%. `memory_budget_mb` (default: the run's
    `config.memory_budget_mb`, else `DEFAULT_MEMORY_BUDGET_MB`) bounds what is held of the
    chunks: pooled gaps are exact while they fit it and a sketch beyond (`slo.sketch`; each
    pooled figure says which, with its relative-error bound).
    """
    try:
        # The chunks are read a row batch at a time (`slo.chunk_digest`) beside the requests'
        # ids and statuses alone; the whole requests table after the pass, once the heap it
        # freed is given back: neither adds to the other's high-water mark.
        ids = open_run(run_dir, chunks=False, columns=[RequestColumn.STATUS])
        spec = _resolve_spec(slo_spec, ids.manifest)
        budget = memory_budget_bytes(memory_budget_mb, ids.manifest)
        digest = read_digest(run_dir, budget_bytes=budget, **digest_options(ids, spec, conventions))
        del ids
        release_free_memory(collect=False)
        tables = open_run(run_dir, chunks=False)
    except RunRecordError as exc:
        raise SLOError(str(exc)) from exc
    return summarize_tables(
        tables,
        slo_spec,
        digest=digest,
        seed=seed,
        conventions=conventions,
        client_bound_ms=client_bound_ms,
        input_edges=input_edges,
        output_edges=output_edges,
        slice_duration_s=slice_duration_s,
    )
