"""The result JSON `vllm bench serve --save-result` writes, from a run directory.

Keys and units as vLLM's `benchmarks/serve.py` writes them: `duration` in s, throughputs per
s, `mean_/median_/std_/pNN_<metric>_ms` in ms over the metrics of `--percentile-metrics`
(ttft, tpot, itl, e2el) under vLLM's own definitions (`slo.conventions.vllm_metrics`), and,
with `detailed`, per-request `input_lens`, `output_lens`, `ttfts` and `itls` (seconds, as
vLLM) and `errors`. Where this harness differs, it says so in the file rather than guessing:
a value that is undefined (a failed request's TTFT) is `null`, not vLLM's 0.0; the generated
texts are not kept by the harness (only their sha256), so `generated_texts` is absent;
`request_goodput` uses the run's SLO per-request limits under this harness's definitions.
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
from slo.runrecord import Endpoint, Goodput, RunSummary
from slo.summary import summarize_tables

VLLM_METRICS = ("ttft", "tpot", "itl", "e2el")


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
    rate = config.get("request_rate")
    if rate is None:  # the workload's own arrival rate
        spec = ((manifest.workload or {}).get("parameters") or {}).get("spec") or {}
        rate = (spec.get("arrivals") or {}).get("rate")
    model_id = target.get("model") or ""
    result = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": label or backend,
        "model_id": model_id,
        "tokenizer_id": config.get("tokenizer") or (manifest.workload or {}).get("tokenizer"),
        "num_prompts": len(rm),
        "request_rate": "inf" if rate == "inf" or rate == math.inf else rate,
        "burstiness": config.get("burstiness") or 1.0,
        "max_concurrency": config.get("concurrency"),
        **(metadata or {}),
        "duration": duration,
        "completed": int(ok.sum()),
        "failed": int((~ok).sum()),
        "total_input_tokens": int(total_input),
        "total_output_tokens": total_output,
        "request_throughput": per_s(float(ok.sum())),
        "request_goodput": goodput.request_per_s,
        "output_throughput": per_s(float(total_output)),
        "total_token_throughput": per_s(total_input + total_output),
        "max_output_tokens_per_s": max_tokens_per_s,
        "max_concurrent_requests": max_concurrent,
    }
    values = {"ttft": vllm.ttft_ms, "tpot": vllm.tpot_ms, "itl": vllm.chunks.gaps_ms,
              "e2el": vllm.e2el_ms}  # fmt: skip
    for name in percentile_metrics:
        result.update(_stats(name, values[name], metric_percentiles))
    if detailed:
        result.update(_detailed(rm, vllm, output_lens))
    result["harness_notes"] = (
        "written by llm-bench from its run directory: undefined values are null (vLLM "
        "writes 0.0), generated_texts are not kept, request_goodput uses the run's SLO"
    )
    return result


def _detailed(rm: RequestMetrics, vllm, output_lens: np.ndarray) -> dict:
    ok_index = {rid: i for i, rid in enumerate(vllm.request_id)}
    ttfts, itls, errors = [], [], []
    for rid, message, status in zip(rm.request_id, rm.error_message, rm.status, strict=True):
        i = ok_index.get(rid)
        ttft_ms = vllm.ttft_ms[i] if i is not None else math.nan
        ttfts.append(None if math.isnan(ttft_ms) else float(ttft_ms) / 1e3)
        gaps = vllm.chunks.gaps_by_request.get(rid) if i is not None else None
        itls.append([] if gaps is None else [float(g) / 1e3 for g in gaps])
        errors.append("" if i is not None else (message or str(status)))
    inputs = [None if math.isnan(x) else int(x) for x in rm.input_tokens]
    return {"input_lens": inputs, "output_lens": [int(x) for x in output_lens],
            "ttfts": ttfts, "itls": itls, "errors": errors}  # fmt: skip


def vllm_result_filename(result: dict) -> str:
    """vLLM's default file name: `{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`."""
    concurrency = result.get("max_concurrency")
    concurrency_part = f"-concurrency{concurrency}" if concurrency is not None else ""
    model = str(result.get("model_id") or "model").split("/")[-1]
    rate = result.get("request_rate")
    return f"{result['label']}-{rate}qps{concurrency_part}-{model}-{result['date']}.json"
