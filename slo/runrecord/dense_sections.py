"""The `dense` block of `summary.json`: what an embeddings or rerank run sent and at what rate.

Written by `slo.dense.dense_summary` (None for runs that generate text). Such requests answer
whole: their latency is the request's (`latency_ms.e2e`), TTFT, TPOT and ITL are undefined
(`undefined_metrics` says why), and their tokens are their inputs'.
"""

from __future__ import annotations

from dataclasses import dataclass

from slo.runrecord.section import Section, nested
from slo.runrecord.sections import Distribution


@dataclass(frozen=True)
class Dense(Section):
    """`api` (`embeddings` or `rerank`); over the ok requests: `texts_per_request` (the batch
    size: inputs, or documents beside the query), `texts_per_s` (texts embedded or scored
    a second over the run's window), `input_tokens` per request and `input_tokens_per_s`,
    counted as `input_tokens_source` says (`usage`: the server's `usage.prompt_tokens` on every
    ok request; `workload`: the run's tokenizer on the texts sent, where any answer lacked
    usage), `request_per_s` and the request latency `latency_ms` (the same figures as
    `throughput.request_per_s` and `latency_ms.e2e`, kept beside the others)."""

    api: str | None = None
    texts_per_request: Distribution | None = nested(Distribution)
    texts_per_s: float | None = None
    input_tokens: Distribution | None = nested(Distribution)
    input_tokens_per_s: float | None = None
    input_tokens_source: str | None = None
    request_per_s: float | None = None
    latency_ms: Distribution | None = nested(Distribution)
