"""Merging the workers' Prometheus texts: one HELP and TYPE per family, each sample with its
worker label, written out by hand."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine_ref.cluster.exposition import RouterCounts, merge_expositions, router_families

WORKER = """\
# HELP vllm:num_requests_running Running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} R
# HELP vllm:ttft_seconds TTFT.
# TYPE vllm:ttft_seconds histogram
vllm:ttft_seconds_bucket{le="0.1",model_name="m"} B
vllm:ttft_seconds_count{model_name="m"} C
vllm:ttft_seconds_sum{} S
bare_total V
"""


def _worker(values: str) -> str:
    text = WORKER
    for placeholder, value in zip("RBCSV", values.split(), strict=True):
        text = text.replace(f" {placeholder}\n", f" {value}\n")
    return text


def test_families_are_merged_worker_by_worker():
    merged = merge_expositions([("0", _worker("1 2 3 0.5 7")), ("1", _worker("4 5 6 1.5 8"))])
    assert merged == (
        "# HELP vllm:num_requests_running Running.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{worker="0",model_name="m"} 1\n'
        'vllm:num_requests_running{worker="1",model_name="m"} 4\n'
        "# HELP vllm:ttft_seconds TTFT.\n"
        "# TYPE vllm:ttft_seconds histogram\n"
        'vllm:ttft_seconds_bucket{worker="0",le="0.1",model_name="m"} 2\n'
        'vllm:ttft_seconds_count{worker="0",model_name="m"} 3\n'
        'vllm:ttft_seconds_sum{worker="0"} 0.5\n'
        'vllm:ttft_seconds_bucket{worker="1",le="0.1",model_name="m"} 5\n'
        'vllm:ttft_seconds_count{worker="1",model_name="m"} 6\n'
        'vllm:ttft_seconds_sum{worker="1"} 1.5\n'
        'bare_total{worker="0"} 7\n'
        'bare_total{worker="1"} 8\n'
    )
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert [s.labels["worker"] for s in families["vllm:ttft_seconds"].samples] == list("000111")


def test_the_router_families():
    counts = RouterCounts("least-loaded", routed=[3, 4], inflight=[1, 0], up=[True, False],
                          fallbacks=2)  # fmt: skip
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(router_families(counts))
        for s in f.samples
    }
    assert samples == {
        ("router_requests_total", (("policy", "least-loaded"), ("worker", "0"))): 3,
        ("router_requests_total", (("policy", "least-loaded"), ("worker", "1"))): 4,
        ("router_inflight", (("worker", "0"),)): 1,
        ("router_inflight", (("worker", "1"),)): 0,
        ("router_worker_up", (("worker", "0"),)): 1,
        ("router_worker_up", (("worker", "1"),)): 0,
        ("router_prefix_affinity_fallbacks_total", ()): 2,
    }
