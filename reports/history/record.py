"""One run as the history keeps it: what makes it comparable, and its headline figures with an
interval each, read once from the run directory.

The history must outlive the run directories (nightly runs get cleaned up), so everything the
trend views and the trend gate need is copied here: the figures come from the run's
`summary.json` (or `slo.summarize` when the run has none, as `bench report` does); each
figure's interval is the summary's bootstrap interval where slo computed one (latency p50,
p90, p99), else a seeded bootstrap over the run's requests:

- latency percentiles: `slo.stats.bootstrap_quantile_ci` over the ok requests' values, as
  the report card does; for ITL, whose pooled gaps come in runs of one request's gaps,
  requests are resampled with all their gaps (resampling gaps alone would call a request's
  many equal gaps independent and give an interval far too narrow). The summary's ITL
  interval is not used for that reason. The gaps are read as the summary reads them
  (`slo.chunk_digest`, a row batch at a time): exact while they fit the run's memory budget,
  else a sketch per request whose buckets are resampled with their counts;
- rates: requests are resampled and the rate recomputed (sum over the window); the interval
  is applied as a ratio to slo's figure, so it brackets the figure the summary states. Above
  `DIRECT_LIMIT` values x resamples the normal approximation of a sum is used instead;
- attainment: `slo.stats.bootstrap_proportion_ci` over the good-request flags.

Runs are keyed by what makes them comparable (`SeriesKey`): the workload's table hash, the
engine and its version, the model (name, hash when recorded, dtype, quantization) and the
hardware (CPU model and GPU). `run_id` identifies a run: the manifest's `run_id` when it has
one, else a hash of the manifest's identity fields, so a copy of a run directory is the same
run and adding it twice changes nothing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from reports.errors import ReportError
from reports.history.catalogue import HISTORY_METRICS, HistoryMetric
from slo.chunk_digest import read_digest
from slo.comparison import Statistic, weighted_statistic
from slo.errors import SLOError
from slo.frame import RequestMetrics
from slo.goodput import good_mask
from slo.runrecord import (
    Endpoint,
    RunManifest,
    RunRecordError,
    RunSummary,
    open_run,
    read_summary,
)
from slo.runrecord.reader import SUMMARY_FILE
from slo.sketch import bucket_value
from slo.spec import as_spec
from slo.stats import bootstrap_ci, bootstrap_proportion_ci, bootstrap_quantile_ci
from slo.summary import memory_budget_bytes, summarize

CONFIDENCE = 0.95
N_RESAMPLES = 1000
DIRECT_LIMIT = 5_000_000  # values x resamples above which a rate's interval is approximated
WEIGHT_CELLS = 8_000_000  # resamples x gaps weighed at once by the ITL interval (64 MB)
SEED = 0
_Z_975 = 1.959963984540054
KEY_FIELDS = (
    "workload_sha256",
    "engine",
    "engine_version",
    "model",
    "model_sha256",
    "dtype",
    "hardware",
    "request_api",
)


@dataclass(frozen=True)
class SeriesKey:
    """What must match for two runs to line up in one series. `workload_name` is shown, not
    compared (the table hash is); None where the manifest does not say."""

    workload_name: str | None = None
    workload_sha256: str | None = None
    engine: str | None = None
    engine_version: str | None = None
    model: str | None = None
    model_sha256: str | None = None
    dtype: str | None = None
    hardware: str | None = None
    request_api: str | None = (
        None  # how requests were sent, when not streamed completions (`api_of`)
    )

    @property
    def series_id(self) -> str:
        """Twelve hex digits of the md5 of the key fields joined by U+001F (None as ""); the
        same expression in SQL backfills it in the schema migration (`reports.history.schema`)."""
        text = "\x1f".join(getattr(self, f) or "" for f in KEY_FIELDS)
        return hashlib.md5(text.encode()).hexdigest()[:12]

    @property
    def label(self) -> str:
        """One line for people: workload, target, model, hardware."""
        workload = self.workload_name or "?"
        if self.workload_sha256:
            workload += f"@{self.workload_sha256[:8]}"
        target = " ".join(v for v in (self.engine, self.engine_version) if v) or "unknown engine"
        model = " ".join(v for v in (self.model, self.dtype) if v) or "unknown model"
        if self.model_sha256:
            model += f"@{self.model_sha256[:8]}"
        if self.request_api:
            workload += f" ({self.request_api})"
        return f"{workload} · {target} · {model} · {self.hardware or 'unknown hardware'}"


@dataclass(frozen=True)
class MetricPoint:
    """One figure of one run with its interval (None where it has none) and how many values
    stood behind it."""

    value: float
    ci_low: float | None = None
    ci_high: float | None = None
    n: int | None = None


@dataclass(frozen=True)
class HistoryRun:
    """A run as the history holds it. `started_at` is UTC (naive), None when unrecorded."""

    run_id: str
    key: SeriesKey
    run_dir: str
    started_at: datetime | None = None
    complete: bool | None = None
    n_requests: int | None = None
    slo_name: str | None = None
    git_sha: str | None = None
    metrics: dict[str, MetricPoint] = field(default_factory=dict)


def parse_started_at(text: str | None) -> datetime | None:
    """An ISO 8601 time as naive UTC; None when absent or not a time."""
    if not text:
        return None
    try:
        moment = datetime.fromisoformat(str(text))
    except ValueError:
        return None
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC).replace(tzinfo=None)
    return moment


def api_of(manifest: RunManifest) -> str | None:
    """How the run sent its requests, as a key: None for streamed completions (the default,
    and what runs before other APIs existed did), else the endpoint, `not streamed` and the
    texts a request (`--batch-size`) where they apply, e.g. `embeddings, batch 8`."""
    config = manifest.config or {}
    said = str((manifest.target or {}).get("endpoint") or config.get("endpoint") or "")
    said = said.rstrip("/").removeprefix("/v1")  # a name, or a path as vLLM spells it
    endpoint = next((e for e in Endpoint if said in (e.value, e.path)), None)
    parts = [endpoint.value] if endpoint not in (None, Endpoint.COMPLETIONS) else []
    if config.get("stream") is False:
        parts.append("not streamed")
    batch = config.get("batch_size")
    if batch is not None and batch != 1:
        parts.append(
            f"batch {json.dumps(batch, sort_keys=True) if isinstance(batch, dict) else batch}"
        )
    return ", ".join(parts) or None


def series_key(manifest: RunManifest) -> SeriesKey:
    """The comparability key of a run from its manifest."""
    target, workload, hardware = manifest.target or {}, manifest.workload or {}, manifest.hardware
    machine = " + ".join(
        str(v) for v in ((hardware or {}).get("cpu"), (hardware or {}).get("gpu")) if v
    )
    model_hash = target.get("model_sha256") or target.get("weights_sha256")

    def text(value) -> str | None:
        return None if value is None else str(value)

    return SeriesKey(
        workload_name=text(workload.get("name")),
        workload_sha256=text(workload.get("sha256")),
        engine=text(target.get("engine")),
        engine_version=text(target.get("engine_version")),
        model=text(target.get("model")),
        model_sha256=text(model_hash),
        dtype=text(target.get("quantization") or target.get("dtype")),
        hardware=machine or None,
        request_api=api_of(manifest),
    )


def run_identity(manifest: RunManifest) -> str:
    """The manifest's `run_id`, else 16 hex digits of a hash of the fields that tell one run
    from another (start time, clock origin, command line, target, workload)."""
    if manifest.run_id:
        return str(manifest.run_id)
    fields_ = {
        "started_at": manifest.started_at,
        "t0_ns": manifest.t0_ns,
        "command_line": manifest.command_line,
        "git_sha": manifest.git_sha,
        "target": manifest.target,
        "workload": (manifest.workload or {}).get("sha256"),
    }
    text = json.dumps(fields_, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _summary(run_dir: Path) -> RunSummary:
    if (run_dir / SUMMARY_FILE).is_file():
        return read_summary(run_dir)
    return RunSummary.from_dict(summarize(run_dir))


def _headline(summary: RunSummary, metric: HistoryMetric):
    """(figure, the summary's own interval or None, n) of `metric` from the summary."""
    if metric.family is not None:
        dist = getattr(summary.latency_ms, metric.family)
        if dist is None or dist.n in (None, 0):
            return None, None, None
        return getattr(dist, f"p{metric.percentile}"), dist.interval(metric.percentile), dist.n
    if metric.key == "goodput_request_per_s":
        goodput = summary.goodput
        return (None if goodput is None else goodput.request_per_s), None, None
    if metric.key == "attainment":
        goodput = summary.goodput
        return (None if goodput is None else goodput.attainment), None, None
    return getattr(summary.throughput, metric.key), None, None


def _latency_values(rm: RequestMetrics, family: str) -> np.ndarray:
    ok = rm.is_ok
    values = rm.pooled_itl_ms(ok) if family == "itl" else getattr(rm, f"{family}_ms")[ok]
    values = np.asarray(values, float)
    return values[~np.isnan(values)]


def _rate_interval(values: np.ndarray, window_s: float, rng) -> tuple[float, float] | None:
    """The interval of sum(values) / window_s, resampling requests."""
    n = values.size
    if n == 0:
        return None
    if n * N_RESAMPLES > DIRECT_LIMIT:
        half = _Z_975 * np.sqrt(n) * float(np.std(values)) / window_s
        centre = float(values.sum()) / window_s
        return centre - half, centre + half
    return bootstrap_ci(
        values,
        lambda r: r.sum(axis=1) / window_s,
        rng=rng,
        confidence=CONFIDENCE,
        n_resamples=N_RESAMPLES,
    )


def _scaled(interval, own: float, figure: float) -> tuple[float, float] | None:
    """`interval` around `own` carried over, as a ratio, to `figure` (slo's number)."""
    if interval is None or not own:
        return None
    return figure * interval[0] / own, figure * interval[1] / own


def _rate_values(rm: RequestMetrics, key: str, good: np.ndarray | None) -> np.ndarray | None:
    ok = rm.is_ok.astype(float)
    tokens_in, tokens_out = np.nan_to_num(rm.input_tokens), np.nan_to_num(rm.output_tokens)
    if key == "request_per_s":
        return ok
    if key == "output_tokens_per_s":
        return ok * tokens_out
    if key == "input_tokens_per_s":
        return ok * tokens_in
    if key == "total_tokens_per_s":
        return ok * (tokens_in + tokens_out)
    if key == "goodput_request_per_s":
        return None if good is None else good.astype(float)
    return None


def _itl_entries(rm: RequestMetrics) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The ok requests' gaps as (values, request group, count) entries from `rm`'s gap pool
    (`read_run` builds it from the chunks' digest): each gap once from an exact pool, each
    (bucket, count) of a request's sketch read back (within the sketch's relative error,
    clamped to that request's exact min and max) from a sketched one."""
    pool = rm.itl_pool
    codes = rm.itl_codes[rm.is_ok]
    codes = codes[codes >= 0]
    codes = codes[pool.count[codes] > 0]
    if codes.size == 0:
        return None
    starts = pool.offsets[codes]
    sizes = pool.offsets[codes + 1] - starts
    groups = np.repeat(np.arange(codes.size), sizes)
    index = np.arange(groups.size) + np.repeat(starts - np.cumsum(sizes) + sizes, sizes)
    if pool.method == "exact":
        return pool.values[index], groups, np.ones(index.size, np.int64)
    values = np.clip(
        bucket_value(pool.buckets[index]),
        np.repeat(pool.low[codes], sizes),
        np.repeat(pool.high[codes], sizes),
    )
    return values, groups, pool.counts[index].astype(np.int64)


def _itl_interval(rm: RequestMetrics, percentile: int, rng) -> tuple[float, float] | None:
    """Bootstrap interval of a pooled-gap percentile, resampling ok requests with their gaps
    (from a sketch: with their buckets' counts)."""
    entries = _itl_entries(rm)
    if entries is None:
        return None
    values, groups, counts = entries
    n_groups = int(groups[-1]) + 1
    order = np.argsort(values, kind="stable")
    sorted_values, sorted_groups, sorted_counts = values[order], groups[order], counts[order]
    n_resamples = int(min(N_RESAMPLES, max(100, DIRECT_LIMIT // values.size)))
    statistic = Statistic("quantile", percentile / 100)
    estimates = []
    # At most WEIGHT_CELLS weights at once: 64 resamples of 30 million gaps were 15 GB
    # (a 30,000-request run of 1,024-token streams; `bench history add` was killed for it).
    batch = max(1, min(64, WEIGHT_CELLS // values.size))
    for start in range(0, n_resamples, batch):
        size = min(batch, n_resamples - start)
        draws = rng.integers(0, n_groups, size=(size, n_groups))
        offsets = (np.arange(size) * n_groups)[:, None]
        times = np.bincount((draws + offsets).ravel(), minlength=size * n_groups)
        weights = times.reshape(size, n_groups)[:, sorted_groups] * sorted_counts
        estimates.append(weighted_statistic(statistic, sorted_values, weights, 1.0))
    alpha = (1 - CONFIDENCE) / 2
    low, high = np.quantile(np.concatenate(estimates), [alpha, 1 - alpha])
    return float(low), float(high)


def _interval(metric, figure, given, rm, window_s, good, rng):
    if metric.family == "itl":
        return _itl_interval(rm, metric.percentile, rng)
    if given is not None:
        return tuple(given)
    if metric.family is not None:
        values = _latency_values(rm, metric.family)
        if values.size == 0:
            return None
        return bootstrap_quantile_ci(
            values,
            float(metric.percentile),
            rng=rng,
            confidence=CONFIDENCE,
            n_resamples=N_RESAMPLES,
        )
    if metric.key == "attainment":
        if good is None or good.size == 0:
            return None
        ci = bootstrap_proportion_ci(good, rng=rng, confidence=CONFIDENCE, n_resamples=N_RESAMPLES)
        return _scaled(ci, float(good.mean()), figure)
    values = _rate_values(rm, metric.key, good)
    if values is None or not window_s:
        return None
    own = float(values.sum()) / window_s
    return _scaled(_rate_interval(values, window_s, rng), own, figure)


def read_run(run_dir: Path | str) -> HistoryRun:
    """The history's record of the run directory `run_dir`.

    Raises ReportError (one sentence) when `run_dir` is not a readable run directory or has no
    manifest (a run without one cannot be placed in a series)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(
            f"{run_dir} is not a directory; pass a run directory written by bench run."
        )
    try:
        tables = open_run(run_dir, chunks=False)
        if tables.manifest is None:
            raise ReportError(
                f"{run_dir} has no manifest.json, so its workload, target and hardware are "
                "unknown; pass a run directory written by bench run."
            )
        summary = _summary(run_dir)
        spec = as_spec(tables.manifest.slo) if tables.manifest.slo else None
        # The chunks a row batch at a time, their gaps held within the run's memory budget
        # (exact while they fit, a per-request sketch beyond), as the summary reads them.
        budget = memory_budget_bytes(None, tables.manifest)
        rm = RequestMetrics.from_tables(tables.requests, read_digest(run_dir, budget_bytes=budget))
        good = good_mask(rm, spec) if spec is not None else None
    except (RunRecordError, SLOError) as exc:
        raise ReportError(str(exc)) from exc
    manifest = tables.manifest
    window_s = rm.window_s()
    rng = np.random.default_rng(SEED)
    points = {}
    for metric in HISTORY_METRICS:
        figure, given, n = _headline(summary, metric)
        if figure is None or not np.isfinite(figure):
            continue
        ci = _interval(metric, float(figure), given, rm, window_s, good, rng)
        points[metric.key] = MetricPoint(
            value=float(figure),
            ci_low=None if ci is None else float(ci[0]),
            ci_high=None if ci is None else float(ci[1]),
            n=None if n is None else int(n),
        )
    return HistoryRun(
        run_id=run_identity(manifest),
        key=series_key(manifest),
        run_dir=str(run_dir.resolve()),
        started_at=parse_started_at(manifest.started_at),
        complete=manifest.complete,
        n_requests=int(summary.counts.total) if summary.counts.total is not None else len(rm),
        slo_name=(manifest.slo or {}).get("name") if isinstance(manifest.slo, dict) else None,
        git_sha=manifest.git_sha,
        metrics=points,
    )
