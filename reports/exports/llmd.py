"""The llm-d Benchmark Report (schema v0.2.1) for a run directory.

The report (llm-d/llm-d-benchmark, `llmdbenchmark/analysis/benchmark_report/`; the tests
validate against its published JSON Schema, kept beside the clone in `../shared/data`) has
three parts: `run` (ids and times), `scenario` (the stack under test and the load) and
`results`: `request_performance.aggregate` (request counts, latency and throughput
statistics with their units) and, for a multi-turn run, `session_performance.sessions`.
v0.2.1 only adds optional fields to v0.2 (multi-modal payloads, engine time series,
sessions), so a v0.2 reader takes the report too. Latencies come from `slo.summarize` under
this harness's definitions (TTFT send to first token, TPOT excluding the first token, ITL
pooled chunk gaps, E2E send to done); throughputs are one figure per run, so their `mean` is
the run's rate. Statistics that are undefined (no ok request, a non-streaming run's TTFT)
are left out, as the schema allows.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from importlib import metadata
from pathlib import Path

import numpy as np

from reports.exports import read_run
from slo.frame import RequestMetrics
from slo.runrecord import Distribution, RequestStatus, RunManifest, RunSummary, Sessions
from slo.summary import summarize_tables

LLMD_REPORT_VERSION = "0.2.1"
DISTRIBUTION = "llm-bench-harness"  # the harness's package, for its version
# Statistics key -> percentile, as the schema spells them (p0p1 = 0.1th percentile).
_PERCENTILES = {"p0p1": 0.1, "p1": 1, "p5": 5, "p10": 10, "p25": 25, "p50": 50, "p75": 75,
                "p90": 90, "p95": 95, "p99": 99, "p99p9": 99.9}  # fmt: skip


def statistics(values, units: str) -> dict | None:
    """A schema `Statistics` object over the defined (non-NaN) values; None with none."""
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return None
    out = {"units": units, "mean": float(values.mean()), "stddev": float(values.std()),
           "min": float(values.min()), "max": float(values.max())}  # fmt: skip
    out.update({key: float(np.percentile(values, q)) for key, q in _PERCENTILES.items()})
    return out


def _rate(value: float | None, units: str) -> dict | None:
    return None if value is None else {"units": units, "mean": float(value)}


def _iso_duration(seconds: float | None) -> str | None:
    return None if seconds is None else f"PT{seconds:.6f}S"


def _iso_time(text: str | None) -> str | None:
    """manifest times (`%Y-%m-%dT%H:%M:%S%z`) in RFC 3339 (`+00:00`), or None."""
    if not text:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S%z").isoformat()
    except ValueError:
        try:
            return datetime.fromisoformat(text).isoformat()
        except ValueError:
            return None


def _cfg_id(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _stack(manifest) -> list[dict]:
    target = manifest.target or {}
    engine = target.get("engine")
    standardized: dict = {"kind": "generic", "tool": engine or "unknown",
                          "tool_version": str(target.get("engine_version") or "unknown")}  # fmt: skip
    if target.get("model"):
        hardware = manifest.hardware or {}
        accelerator = hardware.get("gpu") or hardware.get("cpu") or "unknown"
        standardized = {
            "kind": "inference_engine",
            "tool": engine or "unknown",
            "tool_version": str(target.get("engine_version") or "unknown"),
            "role": "replica",
            "replicas": 1,
            "model": {"name": str(target["model"])},
            "accelerator": {
                "model": str(accelerator),
                "count": 1 if hardware.get("gpu") else 0,
                "parallelism": {"tp": 1, "dp": 1, "pp": 1},
            },  # fmt: skip
        }
    native = {"config": target.get("engine_config")}
    return [{
        "metadata": {"label": f"{engine or 'target'}-0", "cfg_id": _cfg_id(target),
                     "description": f"{target.get('kind', 'url')} target at {target.get('url')}"},
        "standardized": standardized,
        "native": native,
    }]  # fmt: skip


def harness_version(manifest: RunManifest) -> str:
    """The harness version that recorded the run (the manifest's), else the installed one."""
    if manifest.harness_version:
        return manifest.harness_version
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def _load(manifest, rm: RequestMetrics) -> dict:
    workload = manifest.workload or {}
    config = manifest.config or {}
    standardized: dict = {
        "tool": "llm-bench",
        "tool_version": harness_version(manifest),
        "source": "random" if workload.get("synthetic", True) else "sampled",
        "input_seq_len": _sequence(rm.input_tokens),
    }
    ok_output = rm.output_tokens[rm.is_ok]
    if np.nansum(ok_output) > 0:
        standardized["output_seq_len"] = _sequence(ok_output)
    rate = config.get("request_rate")
    if isinstance(rate, int | float) and 0 < rate < float("inf"):
        standardized["rate_qps"] = float(rate)
    if config.get("concurrency"):
        standardized["concurrency"] = int(config["concurrency"])
    return {
        "metadata": {"cfg_id": str(workload.get("sha256") or _cfg_id(workload))[:32],
                     "description": str(workload.get("description") or workload.get("name"))},
        "standardized": standardized,
        "native": {"config": config, "args": None},
    }  # fmt: skip


def _sequence(values) -> dict:
    """A schema `SequenceLength` for token counts (`max` only when at least 1)."""
    values = np.asarray(values, float)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return {"distribution": "other", "value": 0}
    fixed = bool(values.min() == values.max())
    out = {"distribution": "fixed" if fixed else "other", "value": float(values.mean()),
           "min": int(values.min())}  # fmt: skip
    if values.max() >= 1:
        out["max"] = int(values.max())
    if not fixed:
        out["std_dev"] = float(values.std())
    return out


def llmd_report(run_dir: Path | str) -> dict:
    """The llm-d Benchmark Report v0.2.1 dict for `run_dir`. Raises ReportError for an
    unreadable run directory."""
    tables, rm = read_run(run_dir)
    manifest = tables.manifest
    summary = RunSummary.from_dict(summarize_tables(tables))
    ok = rm.is_ok
    counts, throughput = summary.counts, summary.throughput
    by_status = counts.by_status or {}
    latency = {
        "time_to_first_token": statistics(rm.ttft_ms[ok], "ms"),
        "time_per_output_token": statistics(rm.tpot_ms[ok], "ms/token"),
        "inter_token_latency": statistics(rm.pooled_itl_ms(ok), "ms/token"),
        "request_latency": statistics(rm.e2e_ms[ok], "ms"),
        "normalized_time_per_output_token": statistics(
            rm.e2e_ms[ok] / np.where(rm.output_tokens[ok] > 0, rm.output_tokens[ok], np.nan),
            "ms/token",
        ),
    }
    requests = {
        "total": int(counts.total or 0),
        "failures": int(
            sum(n for status, n in by_status.items() if status != RequestStatus.OK.value)
        ),
        "incomplete": int(counts.not_sent or 0),
        "input_length": statistics(rm.input_tokens, "count"),
        "output_length": statistics(rm.output_tokens[ok], "count"),
    }
    rates = {
        "input_token_rate": _rate(throughput.input_tokens_per_s, "tokens/s"),
        "output_token_rate": _rate(throughput.output_tokens_per_s, "tokens/s"),
        "total_token_rate": _rate(throughput.total_tokens_per_s, "tokens/s"),
        "request_rate": _rate(throughput.request_per_s, "queries/s"),
    }
    run = {
        "uid": manifest.run_id or Path(run_dir).name,
        "eid": str((manifest.workload or {}).get("sha256") or "")[:32] or None,
        "time": {
            "start": _iso_time(manifest.started_at),
            "end": _iso_time(manifest.ended_at),
            "duration": _iso_duration(summary.window_s),
        },  # fmt: skip
        "description": "llm-bench run" + ("" if summary.run_complete else " (incomplete)"),
        "keywords": ["llm-bench"],
    }
    results: dict = {"request_performance": {"aggregate": {
        "requests": _drop_none(requests),
        "latency": _drop_none(latency),
        "throughput": _drop_none(rates),
    }}}  # fmt: skip
    if summary.sessions is not None:
        results["session_performance"] = dict(sessions=_sessions(summary.sessions))  # llm-d field
    return {
        "version": LLMD_REPORT_VERSION,
        "run": {k: v for k, v in run.items() if v is not None},
        "scenario": {"stack": _stack(manifest), "load": _load(manifest, rm)},
        "results": results,
    }


def _from_distribution(dist: Distribution | None, units: str) -> dict | None:
    """A schema `Statistics` from a summary `Distribution` (mean, p50..p99, max); None when
    it holds no value."""
    if dist is None or dist.mean is None:
        return None
    out = {"units": units, "mean": float(dist.mean)}
    for key in ("p50", "p90", "p95", "p99", "max"):
        if getattr(dist, key) is not None:
            out[key] = float(getattr(dist, key))
    return out


def _sessions(sessions: Sessions) -> dict:
    """`SessionRequests` from the summary's `sessions` block (`slo.sessions`): a session
    succeeded when every one of its turns ended ok; any other (a turn failed or left unsent)
    counts as failed. Events are turns."""
    total, complete = int(sessions.sessions or 0), int(sessions.complete or 0)
    by_turn = sessions.by_turn or []
    out = {
        "total": total,
        "succeeded": complete,
        "failed": total - complete,
        "total_events": sum(int(t.n or 0) for t in by_turn),
        "total_events_completed": sum(int(t.ok or 0) for t in by_turn),
        "session_duration": _from_distribution(sessions.duration_s, "s"),
        "events_per_session": _from_distribution(sessions.turns, "count"),
    }
    return _drop_none(out)


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}
