"""Prometheus metrics of the reference server, named after vLLM's `vllm:*` metrics so scrapers
written for vLLM read them unchanged.

Every metric carries the label `model_name`. Engine gauges and counters are read from the
engine loop's latest `EngineStats` snapshot at scrape time; latency histograms and request
outcomes are observed by the server as requests stream. All metrics live in the
`CollectorRegistry` owned by one `ServerMetrics` (one per app; no module globals).

| metric | type | source |
|---|---|---|
| `vllm:num_requests_running`, `vllm:num_requests_waiting` | gauge | engine |
| `vllm:kv_cache_usage_perc` (fraction 0..1) | gauge | engine |
| `vllm:kv_cache_blocks_used`, `_free`, `_cached` (engine_ref extension) | gauge | engine |
| `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` (tokens) | counter | engine |
| `vllm:num_preemptions_total` | counter | engine |
| `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` | counter | engine |
| `vllm:time_to_first_token_seconds` | histogram | server: arrival to first token out |
| `vllm:inter_token_latency_seconds` | histogram | server: gap between token-bearing outputs |
| `vllm:e2e_request_latency_seconds` | histogram | server: arrival to finish |
| `vllm:request_time_per_output_token_seconds` | histogram | server: per request TPOT |
| `vllm:request_prompt_tokens`, `vllm:request_generation_tokens` | histogram | server |
| `vllm:request_success_total{finished_reason}` | counter | server: stop, length, abort, error, deadline, shed |
| `vllm:request_rejected_total` (engine_ref extension) | counter | server: 429 answers |
| `vllm:request_shed_total{reason}` (engine_ref extension) | counter | engine: requests refused or ended early by overload control |
| `vllm:model_weight_bytes{layer_kind}` (engine_ref extension) | gauge | engine: weight bytes held |
| `vllm:kv_cache_pool_bytes` (engine_ref extension) | gauge | engine: KV pool bytes, scales included |
| `vllm:kv_memory_block_bytes`, `_unused_slot_bytes`, `_shared_blocks`, `_temp_bytes` (engine_ref extensions) | gauge | engine: memory as of the last step (`core.kv_accounting`) |
| `vllm:kv_evicted_tokens_total`, `vllm:requests_kv_evicted_total` (engine_ref extensions) | counter | engine: lossy KV eviction (`core.kv_eviction`), 0 without it |
| `vllm:spec_decode_num_drafts_total`, `_num_draft_tokens_total`, `_num_accepted_tokens_total` | counter | engine, with speculative decoding |
| `vllm:spec_decode_num_accepted_tokens_per_pos_total{position}` | counter | engine, as vLLM |
| `vllm:spec_decode_acceptance_rate`, `_mean_accepted_length` (engine_ref extensions) | gauge | engine: since start |

`request_shed_total`'s reasons (`engine_ref.core.overload`): `queue_full` (refused, the
waiting queue full), `deadline_infeasible` (refused under `edf`, its deadline out of reach),
`displaced` (a waiting request shed for a better newcomer), `infeasible_shed` (a waiting
request shed under `edf` that could no longer make its deadline), `deadline_missed` (ended
when its deadline passed). Every reason is exported from the start, at 0.

The spec_decode metrics appear only when the engine speculates (its stats carry
`spec_decode`), as vLLM registers them only with a speculative config. vLLM computes the
acceptance rate and mean acceptance length from the counters in its dashboards
(accepted / draft tokens, 1 + accepted / drafts); the two gauges give those same values since
start for a reader without PromQL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "vllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_ITL_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    80.0,
)
_E2E_BUCKETS_S = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)

_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)

# (metric suffix, EngineStats attribute, help)
_GAUGES = (
    ("num_requests_running", "num_running", "Sequences in the running batch (n>1: n each)."),
    ("num_requests_waiting", "num_waiting", "Sequences waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use (0 to 1)."),
    ("kv_cache_blocks_used", "num_blocks_used", "KV-cache blocks held by requests."),
    ("kv_cache_blocks_free", "num_blocks_free", "KV-cache blocks free (including cached ones)."),
    (
        "kv_cache_blocks_cached",
        "num_blocks_cached",
        "KV-cache blocks holding reusable prefix content, in use or free.",
    ),
)
_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_query_tokens", "Prompt tokens looked up."),
    ("prefix_cache_hits", "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "num_preemptions", "Requests preempted (recomputed) so far."),
    ("prompt_tokens", "prompt_tokens_total", "Prompt tokens prefilled so far."),
    ("generation_tokens", "generation_tokens_total", "Tokens generated so far."),
)

_SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "num_drafts", "Verify steps of a sequence with drafted tokens."),
    ("spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens proposed and verified."),
    (
        "spec_decode_num_accepted_tokens",
        "num_accepted_tokens",
        "Draft tokens the target model accepted.",
    ),
)
_SPEC_GAUGES = (
    (
        "spec_decode_acceptance_rate",
        "acceptance_rate",
        "Accepted / draft tokens since start (0 before any draft).",
    ),
    (
        "spec_decode_mean_accepted_length",
        "mean_accepted_length",
        "Tokens emitted per verify step since start: 1 + accepted / drafts.",
    ),
)


_KV_MEMORY_HELP = {  # engine_ref.core.kv_accounting: memory as of the last step
    "block_bytes": "Bytes one KV block holds across every layer (scales included).",
    "unused_slot_bytes": "KV bytes of allocated slots holding no token (fragmentation).",
    "shared_blocks": "KV blocks referenced by more than one running sequence.",
    "temp_bytes": "Modelled peak temporary bytes of the last step (activations, logits, gathers).",
}


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, get_stats: Any) -> None:
        self._model_name = model_name
        self._get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        if stats is None:
            return
        for suffix, attribute, help_text in _GAUGES:
            family = GaugeMetricFamily(PREFIX + suffix, help_text, labels=["model_name"])
            family.add_metric([self._model_name], float(getattr(stats, attribute)))
            yield family
        for suffix, attribute, help_text in _COUNTERS:
            family = CounterMetricFamily(PREFIX + suffix, help_text, labels=["model_name"])
            family.add_metric([self._model_name], float(getattr(stats, attribute)))
            yield family
        weight_bytes = getattr(stats, "weight_bytes_by_kind", None)
        if weight_bytes:
            family = GaugeMetricFamily(
                PREFIX + "model_weight_bytes",
                "Bytes of model weights the engine holds, by layer kind (quantized or not).",
                labels=["model_name", "layer_kind"],
            )
            for kind, num_bytes in weight_bytes.items():
                family.add_metric([self._model_name, kind], float(num_bytes))
            yield family
        pool_bytes = getattr(stats, "kv_pool_bytes", None)
        if pool_bytes is not None:
            family = GaugeMetricFamily(
                PREFIX + "kv_cache_pool_bytes",
                "Bytes of every layer's KV pool, values and scales (--kv-cache-dtype).",
                labels=["model_name"],
            )
            family.add_metric([self._model_name], float(pool_bytes))
            yield family
        shed = getattr(stats, "requests_shed_by_reason", None)
        if shed is not None:
            family = CounterMetricFamily(
                PREFIX + "request_shed",
                "Requests refused or ended early by overload control, by reason.",
                labels=["model_name", "reason"],
            )
            for reason, count in shed.items():
                family.add_metric([self._model_name, reason], float(count))
            yield family
        for name, value in (getattr(stats, "kv_memory", None) or {}).items():
            family = GaugeMetricFamily(
                PREFIX + "kv_memory_" + name, _KV_MEMORY_HELP[name], labels=["model_name"]
            )
            family.add_metric([self._model_name], float(value))
            yield family
        eviction = getattr(stats, "kv_eviction", None)
        if eviction is not None:
            for suffix, count, help_text in (
                ("kv_evicted_tokens", eviction.num_evicted_tokens, "Tokens whose KV was evicted."),
                ("requests_kv_evicted", eviction.num_requests_evicted, "Requests that evicted KV."),
            ):
                family = CounterMetricFamily(PREFIX + suffix, help_text, labels=["model_name"])
                family.add_metric([self._model_name], float(count))
                yield family
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:
            yield from self._spec_decode(spec)

    def _spec_decode(self, spec: Any) -> Iterator[Metric]:
        labels = ["model_name"]
        for suffix, attribute, help_text in _SPEC_COUNTERS:
            family = CounterMetricFamily(PREFIX + suffix, help_text, labels=labels)
            family.add_metric([self._model_name], float(getattr(spec, attribute)))
            yield family
        family = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position (0-based) was accepted.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            family.add_metric([self._model_name, str(position)], float(count))
        yield family
        for suffix, attribute, help_text in _SPEC_GAUGES:
            family = GaugeMetricFamily(PREFIX + suffix, help_text, labels=labels)
            family.add_metric([self._model_name], float(getattr(spec, attribute)))
            yield family


class ServerMetrics:
    """The server's metrics registry; `get_stats` returns the latest EngineStats or None."""

    def __init__(self, model_name: str, get_stats: Any) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(model_name, get_stats))
        labels = ["model_name"]
        self.ttft_s = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first output token.",
            labels,
            registry=self.registry,
            buckets=_TTFT_BUCKETS_S,
        ).labels(model_name)
        self.itl_s = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between successive token-bearing outputs of one request.",
            labels,
            registry=self.registry,
            buckets=_ITL_BUCKETS_S,
        ).labels(model_name)
        self.e2e_s = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last output.",
            labels,
            registry=self.registry,
            buckets=_E2E_BUCKETS_S,
        ).labels(model_name)
        self.tpot_s = Histogram(
            PREFIX + "request_time_per_output_token_seconds",
            "Per request: (last token time - first token time) / (output tokens - 1).",
            labels,
            registry=self.registry,
            buckets=_ITL_BUCKETS_S,
        ).labels(model_name)
        self.prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens",
            "Prompt length of each finished request, in tokens.",
            labels,
            registry=self.registry,
            buckets=_TOKEN_BUCKETS,
        ).labels(model_name)
        self.generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Output tokens of each finished request (all its samples).",
            labels,
            registry=self.registry,
            buckets=_TOKEN_BUCKETS,
        ).labels(model_name)
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason (abort: client gone, fell behind, or engine "
            "loop failure; error: the engine failed the request alone; deadline: its deadline "
            "passed; shed: shed under overload).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in ("stop", "length", "abort", "error", "deadline", "shed"):
            self._success.labels(model_name, reason)
        self._rejected = Counter(
            PREFIX + "request_rejected",
            "Requests answered HTTP 429: refused for overload (a full waiting queue, a deadline "
            "out of reach) or shed before they were answered.",
            labels,
            registry=self.registry,
        ).labels(model_name)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def request_finished(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def request_rejected(self) -> None:
        self._rejected.inc()

    def tracker(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Latency bookkeeping for one engine request (times from `time.perf_counter`)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self.t_arrival_s = time.perf_counter()
        self._t_first_token_s: float | None = None
        self._t_last_token_s: float | None = None
        self._num_tokens = 0

    def tokens_out(self, num_tokens: int) -> None:
        """Call once per output that carried `num_tokens` > 0 new tokens."""
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if self._t_last_token_s is None:
            self._metrics.ttft_s.observe(now - self.t_arrival_s)
            self._t_first_token_s = now
        else:
            self._metrics.itl_s.observe(now - self._t_last_token_s)
        self._t_last_token_s = now
        self._num_tokens += num_tokens

    def finished(self, finished_reason: str, *, num_prompt_tokens: int | None = None) -> None:
        """Call once when the request ends; `num_prompt_tokens` None (aborted before the
        engine reported it) skips the token histograms."""
        metrics = self._metrics
        metrics.e2e_s.observe(time.perf_counter() - self.t_arrival_s)
        metrics.request_finished(finished_reason)
        if self._num_tokens > 1 and self._t_first_token_s is not None:
            assert self._t_last_token_s is not None
            gap_s = self._t_last_token_s - self._t_first_token_s
            metrics.tpot_s.observe(gap_s / (self._num_tokens - 1))
        if num_prompt_tokens is not None:
            metrics.prompt_tokens.observe(num_prompt_tokens)
            metrics.generation_tokens.observe(self._num_tokens)
