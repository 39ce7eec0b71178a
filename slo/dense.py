"""The `dense` block of a run's summary: embeddings and rerank runs (`slo.runrecord.Dense`).

A dense request carries a batch of texts and answers whole, so what matters is how many
requests, texts and input tokens a second the target took and each request's latency. Input
tokens are the server's (`usage_prompt_tokens`) when every ok request reported them, else the
run's own count of the texts sent (`input_tokens`): one source for the whole block, so the
rate never mixes two tokenizers.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from slo import metrics
from slo.frame import RequestMetrics
from slo.runrecord import Endpoint, RequestColumn, RunManifest, float_column

# Why each token latency has no value in an embeddings or rerank run.
DENSE_UNDEFINED = {
    name: "undefined: embeddings and rerank answer whole and generate no tokens (the request "
    "latency, E2E, is defined)"
    for name in ("ttft", "tpot", "itl", "itl_request_mean", "itl_max", "ttft_from_scheduled")
}


def dense_endpoint(manifest: RunManifest | None) -> Endpoint | None:
    """The run's endpoint when it is embeddings or rerank (the manifest's target), else None."""
    recorded = ((manifest.target if manifest is not None else None) or {}).get("endpoint")
    try:
        endpoint = Endpoint(recorded)
    except ValueError:
        return None
    return None if endpoint.generates else endpoint


def dense_summary(
    requests: pa.Table, rm: RequestMetrics, manifest: RunManifest | None
) -> dict | None:
    """The `dense` block of a run whose endpoint is embeddings or rerank, None for the others.
    `requests` is the sent requests' table, aligned with `rm`."""
    endpoint = dense_endpoint(manifest)
    if endpoint is None:
        return None
    ok = rm.is_ok
    window_s = rm.window_s()
    batch = float_column(requests, RequestColumn.NUM_TEXTS)[ok]
    usage = float_column(requests, RequestColumn.USAGE_PROMPT_TOKENS)[ok]
    counted = float_column(requests, RequestColumn.INPUT_TOKENS)[ok]
    by_server = usage.size > 0 and not np.isnan(usage).any()
    tokens = usage if by_server else counted

    def rate(values: np.ndarray) -> float | None:
        return float(np.nansum(values)) / window_s if window_s else None

    return {
        "api": endpoint.value,
        "texts_per_request": metrics.distribution(batch),
        "texts_per_s": rate(batch),
        "input_tokens": metrics.distribution(tokens),
        "input_tokens_per_s": rate(tokens),
        "input_tokens_source": "usage" if by_server else "workload",
        "request_per_s": int(ok.sum()) / window_s if window_s else None,
        "latency_ms": metrics.distribution(rm.e2e_ms[ok]),
    }
