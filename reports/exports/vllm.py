"""The result JSON `vllm bench serve --save-result` writes, from a run directory.

Keys and units as vLLM's `vllm/benchmarks/serve.py` writes them today: `duration` in s,
throughputs per s, `mean_/median_/std_/pNN_<metric>_ms` in ms over the metrics of
`--percentile-metrics` under vLLM's own definitions (`slo.conventions.vllm_metrics`);
`max_output_tokens_per_s` (the fullest one-second bucket of output tokens) and
`max_concurrent_requests` (the most requests in flight at once) as `slo.conventions.vllm_peaks`;
`request_goodput`, the good requests per second under the run's per-request limits (`--goodput`
or the SLO's `per_request`), null when the run has none, as vLLM writes None without
`--goodput`. Per request, in the run's request order and in seconds as vLLM: `latencies` and
`queue_times` always (vLLM keeps them without `--save-detailed` too), and with `detailed`
`input_lens`, `output_lens`, `ttfts`, `itls`, `start_times`, `generated_texts` and `errors`.

Where this harness differs it says so in the file rather than guessing: a value that is
undefined (a failed request's TTFT or latency) is null, not vLLM's 0.0; `start_times` count
from the run's start (vLLM's are `perf_counter` readings, whose origin is arbitrary too); the
harness keeps only a sha256 of each output, so each `generated_texts` entry is null; and the
goodput judges each request by this harness's definitions (`slo.goodput`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from reports.errors import ReportError
from reports.exports import read_run
from slo.conventions import vllm_metrics, vllm_peaks
from slo.frame import RequestMetrics
from slo.runrecord import Endpoint, Goodput, RunManifest, RunSummary
from slo.spec import as_spec
from slo.summary import summarize_tables

# vLLM's --percentile-metrics names; the last two only with --max-concurrency, as in vLLM
VLLM_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
# kept in the file only with --save-detailed (vLLM drops these without it)
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts",
                 "errors")  # fmt: skip
NOTES = (
    "written by llm-bench from its run directory: undefined values are null (vLLM writes "
    "0.0), start_times count from the run's start, generated_texts are not kept (null), "
    "request_goodput judges requests by the harness's definitions against the run's limits"
)


def _percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, values_ms: np.ndarray, percentiles: tuple[float, ...]) -> dict:
    values = np.asarray(values_ms, float)
    values = values[~np.isnan(values)]
    defined = values.size > 0
    out = {
        f"mean_{name}_ms": float(values.mean()) if defined else None,
        f"median_{name}_ms": float(np.median(values)) if defined else None,
        f"std_{name}_ms": float(values.std()) if defined else None,
    }
    for p in percentiles:
        value = float(np.percentile(values, p)) if defined else None
        out[f"p{_percentile_key(p)}_{name}_ms"] = value
    return out


def _endpoint(manifest) -> Endpoint:
    recorded = str((manifest.target or {}).get("endpoint") or "")
    return Endpoint.CHAT if Endpoint.CHAT.value in recorded else Endpoint.COMPLETIONS


def _has_request_limits(manifest: RunManifest) -> bool:
    """Whether the run's SLO sets a per-request limit (what makes a request good or not)."""
    if not isinstance(manifest.slo, dict):
        return False
    spec = as_spec(manifest.slo)
    objectives = [spec.per_request, *(override.per_request for override in spec.slices)]
    return any(v is not None for o in objectives for v in vars(o).values())


def _seconds(values_ms: np.ndarray) -> list[float | None]:
    return [None if math.isnan(v) else float(v) / 1e3 for v in np.asarray(values_ms, float)]


def _rate(manifest: RunManifest):
    config = manifest.config or {}
    rate = config.get("request_rate")
    if rate is None:  # the workload's own arrival rate
        spec = ((manifest.workload or {}).get("parameters") or {}).get("spec") or {}
        rate = (spec.get("arrivals") or {}).get("rate")
    return "inf" if rate == "inf" or rate == math.inf else rate


def vllm_result(
    run_dir: Path | str,
    *,
    backend: str = "vllm",
    label: str | None = None,
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl"),
    metric_percentiles: tuple[float, ...] = (99.0,),
    detailed: bool = False,
    metadata: dict | None = None,
) -> dict:
    """The vLLM result dict for `run_dir` (see the module docstring). Raises ReportError for
    an unreadable run directory or an unknown metric name."""
    unknown = [m for m in percentile_metrics if m not in VLLM_METRICS]
    if unknown:
        raise ReportError(f"unknown vLLM metric {unknown[0]!r}; known: {', '.join(VLLM_METRICS)}.")
    tables, rm = read_run(run_dir)
    manifest = tables.manifest
    summary = RunSummary.from_dict(summarize_tables(tables))
    vllm = vllm_metrics(rm, tables.chunks, _endpoint(manifest))
    ok = rm.is_ok
    duration = summary.window_s or 0.0
    total_input = float(np.nansum(rm.input_tokens[ok]))
    output_lens = np.where(ok, np.nan_to_num(rm.output_tokens), 0).astype(int)
    total_output = int(output_lens.sum())
    max_tokens_per_s, max_concurrent = vllm_peaks(vllm, rm.t_sent_ns[ok])
    per_s = (lambda x: x / duration) if duration else (lambda x: None)
    goodput = summary.goodput or Goodput.empty()
    config = manifest.config or {}
    target = manifest.target or {}
    rate = _rate(manifest)
    arrays = _per_request(rm, vllm, output_lens)
    result = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": label or backend,
        "model_id": target.get("model") or "",
        "tokenizer_id": config.get("tokenizer") or (manifest.workload or {}).get("tokenizer"),
        "num_prompts": len(rm),
        "request_rate": rate,
        "burstiness": config.get("burstiness") or 1.0,
        "max_concurrency": config.get("concurrency"),
        **(metadata or {}),
        "duration": duration,
        "completed": int(ok.sum()),
        "failed": int((~ok).sum()),
        "total_input_tokens": int(total_input),
        "total_output_tokens": total_output,
        "request_throughput": per_s(float(ok.sum())),
        "request_goodput": goodput.request_per_s if _has_request_limits(manifest) else None,
        "output_throughput": per_s(float(total_output)),
        "total_token_throughput": per_s(total_input + total_output),
        **{k: v for k, v in arrays.items() if detailed or k not in DETAILED_KEYS},
        "max_output_tokens_per_s": max_tokens_per_s,
        "max_concurrent_requests": max_concurrent,
        "rtfx": 0.0,  # audio seconds per second: text runs have none, as vLLM writes for them
    }
    queue_ms = (rm.t_sent_ns - rm.t_scheduled_ns)[ok] / 1e6
    values = {"ttft": vllm.ttft_ms, "tpot": vllm.tpot_ms, "itl": vllm.chunks.gaps_ms,
              "e2el": vllm.e2el_ms}  # fmt: skip
    if result["max_concurrency"] is not None:  # vLLM's client-side queue metrics
        values["client_queue_time"] = queue_ms
        if isinstance(rate, int | float) and math.isfinite(rate):  # vLLM: not at rate inf
            values["e2el_including_client_queue"] = vllm.e2el_ms + queue_ms
    for name in percentile_metrics:
        if name in values:
            result.update(_stats(name, values[name], metric_percentiles))
    result["harness_notes"] = NOTES
    return result


def _per_request(rm: RequestMetrics, vllm, output_lens: np.ndarray) -> dict:
    """vLLM's per-request arrays over every sent request, in table order (seconds)."""
    ok = rm.is_ok
    n = len(rm)
    ttft_ms, e2el_ms = np.full(n, np.nan), np.full(n, np.nan)
    ttft_ms[ok], e2el_ms[ok] = vllm.ttft_ms, vllm.e2el_ms
    gaps = vllm.chunks.gaps_by_request
    itls = [
        [float(g) / 1e3 for g in gaps.get(rid, ())] if is_ok else []
        for rid, is_ok in zip(rm.request_id, ok, strict=True)
    ]
    errors = [
        "" if is_ok else (message or str(status))
        for message, status, is_ok in zip(rm.error_message, rm.status, ok, strict=True)
    ]
    return {
        "input_lens": [None if math.isnan(x) else int(x) for x in rm.input_tokens],
        "output_lens": [int(x) for x in output_lens],
        "ttfts": _seconds(ttft_ms),
        "itls": itls,
        "latencies": _seconds(e2el_ms),
        "start_times": _seconds(rm.t_sent_ns / 1e6),
        "queue_times": _seconds((rm.t_sent_ns - rm.t_scheduled_ns) / 1e6),
        "generated_texts": [None] * n,
        "errors": errors,
    }


def vllm_result_filename(result: dict) -> str:
    """vLLM's default file name: `{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`."""
    concurrency = result.get("max_concurrency")
    concurrency_part = f"-concurrency{concurrency}" if concurrency is not None else ""
    model = str(result.get("model_id") or "model").split("/")[-1]
    rate = result.get("request_rate")
    return f"{result['label']}-{rate}qps{concurrency_part}-{model}-{result['date']}.json"
