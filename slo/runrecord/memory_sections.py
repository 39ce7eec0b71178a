"""The `memory` block of `summary.json`: memory per request, as the target reported it or as
the harness estimated it from the target's KV cache gauge.

Written by `slo.memory.memory_summary`; the definitions are in that module's docstring and,
for the reported figures, in `engine_ref.core.kv_accounting`. Bytes are bytes, shares are
fractions of the KV pool, "no value" None.
"""

from __future__ import annotations

from dataclasses import dataclass

from slo.runrecord.section import Section, nested
from slo.runrecord.sections import Distribution


@dataclass(frozen=True)
class MemoryEstimate(Section):
    """Per-request memory estimated from `kv_cache_usage_perc` / `num_requests_running` at each
    scrape with requests running (`samples` of them): `pool_share` the share of the KV pool per
    running request, `bytes_per_request` the same times the pool's bytes when the target reports them
    (`pool_bytes`), else None."""

    samples: int | None = None
    pool_share: Distribution | None = nested(Distribution)
    pool_bytes: int | None = None
    bytes_per_request: Distribution | None = nested(Distribution)


@dataclass(frozen=True)
class Memory(Section):
    """`memory` (`slo.memory.memory_summary`): `source` is `reported` (the server's
    `usage.kv_memory`, requests.parquet), `estimated` (`estimate`) or None with `reason`.
    Reported: the ok requests' distributions of peak, token-weighted mean, amortised (shared
    blocks divided among sharers), unused (fragmentation) KV bytes and peak temporary bytes;
    `requests_evicted` requests whose context was evicted lossily, `evicted_tokens` in all."""

    source: str | None = None
    reason: str | None = None
    kv_peak_bytes: Distribution | None = nested(Distribution)
    kv_mean_bytes: Distribution | None = nested(Distribution)
    kv_amortised_bytes: Distribution | None = nested(Distribution)
    kv_unused_bytes: Distribution | None = nested(Distribution)
    temp_peak_bytes: Distribution | None = nested(Distribution)
    requests_evicted: int | None = None
    evicted_tokens: int | None = None
    estimate: MemoryEstimate | None = nested(MemoryEstimate)
