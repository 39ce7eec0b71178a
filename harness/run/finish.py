"""Finish a driven run: its summary (`slo.summarize`), the workers' section of the manifest,
the verdict and exit code, and the `RunOutcome` the caller gets."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.http.client import ClientOptions
from harness.load.split import WorkerSplit
from harness.run.checks import tally_outputs
from harness.run.outcome import RunOutcome, Verdict, judge, not_found_sentence
from slo import metrics, summarize
from slo.runrecord import (
    RequestColumn,
    RunSummary,
    float_column,
    open_run,
    read_manifest,
    write_json_atomic,
    write_summary,
)


def finish(
    run_dir: Path,
    *,
    reason: str | None,
    stopped_by_errors: bool,
    slo_spec: dict | None,
    client_bound_ms: float,
    check_outputs: bool,
    options: ClientOptions,
    split: WorkerSplit | None = None,
    workers: list[dict] | None = None,
) -> RunOutcome:
    """Summarise the closed run in `run_dir`, judge it and record the verdict (and, for
    `--workers`/`--ray`, the workers' section) in its manifest. `reason` is why it stopped
    early (None: it completed); `stopped_by_errors`: a stop rule stopped it."""
    if split is not None:
        record_workers(run_dir, split, workers or [])
    summary = RunSummary.from_dict(
        summarize(run_dir, slo_spec, client_bound_ms=client_bound_ms, conventions="all")
    )
    write_summary(run_dir, summary)
    requests = open_run(run_dir, chunks=False).requests
    verdict = judge(
        summary,
        stopped_reason=reason,
        stopped_by_errors=stopped_by_errors,
        slo_given=slo_spec is not None,
        outputs=tally_outputs(requests) if check_outputs else None,
        not_found=not_found_hint(requests, options),
    )
    record_outcome(run_dir, verdict)
    return RunOutcome(
        run_dir=run_dir,
        summary=summary,
        complete=reason is None,
        interrupted_reason=reason,
        verdict=verdict,
        stopped_by_errors=stopped_by_errors,
    )


def record_workers(run_dir: Path, split: WorkerSplit, entries: list[dict]) -> None:
    """The manifest's `workers` section: the split, the clocks, and per worker its requests,
    fate and dispatch lag (ms, over the requests it sent)."""
    requests = open_run(run_dir, chunks=False).requests
    owner = split.worker_of()
    ids = requests[RequestColumn.REQUEST_ID].to_pylist()
    lag = metrics.dispatch_lag_ms(  # the summary's definition: a cap's queueing is not lag
        float_column(requests, RequestColumn.T_SCHEDULED_NS),
        float_column(requests, RequestColumn.T_SENT_NS),
        float_column(requests, RequestColumn.T_SLOT_FREED_NS),
    )
    of = np.array([owner.get(rid, -1) for rid in ids])
    per_worker = []
    for entry in entries:
        dist = metrics.distribution(lag[of == entry["worker"]])
        per_worker.append(
            {**entry, "dispatch_lag_ms": {k: dist[k] for k in ("p50", "p99", "max", "n")}}
        )
    section = {**split.manifest_entry(), "per_worker": per_worker}
    manifest = read_manifest(run_dir).evolve(workers=section)
    write_json_atomic(run_dir / "manifest.json", manifest.to_json())


def not_found_hint(requests, options: ClientOptions) -> str | None:
    """`not_found_sentence` for the run's requests table (the first by send time decides)."""
    sent = float_column(requests, RequestColumn.T_SENT_NS)
    status = float_column(requests, RequestColumn.HTTP_STATUS)
    n_sent = int((~np.isnan(sent)).sum())
    if not n_sent:
        return None
    first = status[int(np.nanargmin(sent))]
    first_status = None if np.isnan(first) else int(first)
    n_not_found = int((status == 404).sum())
    return not_found_sentence(
        options.base_url,
        options.url,
        first_status,
        n_not_found,
        n_sent,
        not_sent=len(status) - n_sent,
    )


def record_outcome(run_dir: Path, verdict: Verdict) -> None:
    """The verdict (exit code and sentence) in the manifest's `outcome` section."""
    manifest = read_manifest(run_dir).evolve(outcome=verdict.to_dict())
    write_json_atomic(run_dir / "manifest.json", manifest.to_json())
