"""Synthetic run directories for the reports and gate tests, written with the production
writer (`slo.runrecord.RunWriter`), so they hold only what the contract admits.

`write_run(path, SyntheticRun(...))` writes `manifest.json`, `requests.parquet`,
`chunks.parquet` (and `capacity.json` when asked) from a seeded generator, so the same spec
always gives the same rows. `summary.json` is written by `slo.summarize` when the spec asks
for it, exactly as the harness would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slo.runrecord import (
    RequestRecord,
    RunManifest,
    RunSummary,
    RunWriter,
    TokenSource,
    write_summary,
)

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000


# status -> (http_status, error_class, error_message) for the failed rows a spec asks for.
FAILURE_KINDS = {
    "rejected": ("rejected", 429, "rejected_429", "queue full"),
    "timeout": ("timeout", None, "timeout", "request exceeded 30 s"),
    "cancelled": ("cancelled", None, None, "cancelled by client"),
    "unknown": ("unknown", None, "connection_reset", "connection reset mid-stream"),
    "oom": ("error", 500, "http_5xx", "CUDA out of memory"),
    "http_5xx": ("error", 503, "http_5xx", "service unavailable"),
}

DEFAULT_SLO = {
    "name": "p99",
    "per_request": {"ttft_ms": 200.0, "tpot_ms": 50.0},
    "percentiles": [
        {"metric": "ttft_ms", "percentile": 99, "max_ms": 200.0},
        {"metric": "tpot_ms", "percentile": 99, "max_ms": 50.0},
    ],
    "attainment_min": 0.9,
}


@dataclass(frozen=True)
class SyntheticRun:
    """Parameters of one synthetic run. `workload_seed` draws the requests (arrival times,
    token counts), as a workload would; `seed` draws the service (latencies, dispatch lag).

    Latencies are lognormal around the medians, multiplied by `latency_scale` (1.2 makes a 20%
    regression). `failures` maps a FAILURE_KINDS key to how many of the requests fail that way,
    spread evenly over the run. `wrong_output` marks that many ok requests with an empty output.
    """

    n_requests: int = 120
    seed: int = 0
    workload_seed: int = 0
    rate_per_s: float = 8.0
    ttft_ms_median: float = 60.0
    tpot_ms_median: float = 12.0
    latency_scale: float = 1.0
    output_tokens_range: tuple[int, int] = (8, 40)
    failures: dict = field(default_factory=dict)
    wrong_output: int = 0
    engine: str = "engine_ref"
    engine_version: str = "0.1.0"
    dtype: str | None = "bfloat16"
    kernels: str | None = "avx512-bf16"
    model: str = "tiny-random"
    workload_sha256: str = "a" * 64
    slo: dict | None = field(default_factory=lambda: dict(DEFAULT_SLO))
    fault_windows: list | None = None
    capacity: list | None = None
    write_summary: bool = True
    # ok request i reports usage.kv_memory: peak (i + 1) x 4 KiB, half of it mean, a quarter
    # amortised, 100 bytes unused, 1,000 temporary; request 1 (when ok) had 16 tokens evicted.
    kv_memory: bool = False
    # what the summary may hold of the chunks (`bench run --memory-budget-mb`); None: unrecorded
    memory_budget_mb: float | None = None


# The fixed run behind the golden files: every failure kind, a fault window, a capacity curve.
GOLDEN_SPEC = SyntheticRun(
    n_requests=120,
    seed=0,
    failures={"rejected": 3, "timeout": 2, "oom": 1, "cancelled": 1, "unknown": 1, "http_5xx": 1},
    wrong_output=2,
    fault_windows=[{"start_s": 4.0, "end_s": 6.0, "kind": "latency"}],
    capacity=[
        {"rate": 2.0, "attainment": 1.0, "goodput": 2.0},
        {"rate": 4.0, "attainment": 0.99, "goodput": 3.96},
        {"rate": 8.0, "attainment": 0.91, "goodput": 7.3},
        {"rate": 16.0, "attainment": 0.42, "goodput": 6.7},
    ],
)


def _manifest(spec: SyntheticRun, run_id: str, duration_s: float) -> dict:
    return {
        "harness_version": "0.1.0",
        "git_sha": "0123456789abcdef0123456789abcdef01234567",
        "command_line": f"bench run --workload sharegpt --slo p99 --out runs/{run_id}",
        "run_id": run_id,
        "target": {
            "kind": "managed",
            "url": "http://127.0.0.1:8000",
            "engine": spec.engine,
            "engine_version": spec.engine_version,
            "dtype": spec.dtype,
            "kernels": spec.kernels,
            "model": spec.model,
            "endpoint": "/v1/completions",
            "engine_config": {"max_num_seqs": 64},
        },
        "hardware": {
            "cpu": "Synthetic CPU @ 2.0GHz",
            "cpu_count": 2,
            "memory_bytes": 24 * 1024**3,
            "gpu": None,
        },
        "workload": {
            "name": "sharegpt",
            "generator": "synthetic",
            "parameters": {"num_requests": spec.n_requests, "request_rate": spec.rate_per_s},
            "seed": spec.workload_seed,
            "tokenizer": "tiny-random",
            "sha256": spec.workload_sha256,
            "synthetic": True,
            "source": "tests/reports/rundir_builder.py",
        },
        "slo": spec.slo,
        "fault_plan": None if spec.fault_windows is None else {"windows": spec.fault_windows},
        "started_at": "2026-11-29T10:00:00+00:00",
        "t0_ns": 1_000_000_000_000,
        "config": {"seed": spec.seed}
        | ({} if spec.memory_budget_mb is None else {"memory_budget_mb": spec.memory_budget_mb}),
    }


def write_run(path: Path, spec: SyntheticRun) -> Path:
    """Write a complete run directory for `spec` at `path` (created) and return `path`."""
    path.mkdir(parents=True, exist_ok=True)
    workload_rng = np.random.default_rng(spec.workload_seed)
    rng = np.random.default_rng(spec.seed)
    n = spec.n_requests
    arrivals_ns = np.cumsum(workload_rng.exponential(NS_PER_S / spec.rate_per_s, size=n))
    arrivals_ns = arrivals_ns.astype(np.int64)
    low, high = spec.output_tokens_range
    out_tokens = workload_rng.integers(low, high + 1, size=n)
    in_tokens = workload_rng.integers(32, 256, size=n)
    lag_ns = rng.integers(50_000, 400_000, size=n)
    ttft_ns = (
        spec.ttft_ms_median * spec.latency_scale * NS_PER_MS * rng.lognormal(0.0, 0.3, size=n)
    ).astype(np.int64)
    tpot_ns = (
        spec.tpot_ms_median * spec.latency_scale * NS_PER_MS * rng.lognormal(0.0, 0.2, size=n)
    ).astype(np.int64)

    kinds = [kind for kind, count in sorted(spec.failures.items()) for _ in range(count)]
    failed_at = {}
    if kinds:
        if len(kinds) > n:
            raise ValueError("more failures than requests")
        positions = ((np.arange(len(kinds)) + 0.5) * n / len(kinds)).astype(int)
        failed_at = dict(zip(positions.tolist(), kinds, strict=True))
    ok_positions = [i for i in range(n) if i not in failed_at]
    wrong = set(ok_positions[1 : 1 + 7 * spec.wrong_output : 7][: spec.wrong_output])

    records: list[RequestRecord] = []
    chunks: list[tuple[str, int, int, int]] = []
    for i in range(n):
        rid = f"req-{i:05d}"
        sched = int(arrivals_ns[i])
        sent = sched + int(lag_ns[i])
        row = RequestRecord(
            request_id=rid,
            is_warmup=False,
            t_scheduled_ns=sched,
            t_sent_ns=sent,
            input_tokens=int(in_tokens[i]),
        )
        records.append(row)
        kind = failed_at.get(i)
        if kind is not None:
            status, http, error_class, message = FAILURE_KINDS[kind]
            row.status, row.http_status = status, http
            row.error_class, row.error_message = error_class, message
            row.t_done_ns = sent + (30 * NS_PER_S if status == "timeout" else 5 * NS_PER_MS)
            row.output_tokens = row.client_output_tokens = row.output_chars = row.num_chunks = 0
            row.output_tokens_source = TokenSource.CHUNK_COUNT
        else:
            n_out = 0 if i in wrong else int(out_tokens[i])
            first = sent + int(ttft_ns[i])
            token_times = first + np.arange(max(n_out, 1), dtype=np.int64) * int(tpot_ns[i])
            last = int(token_times[-1])
            row.status, row.http_status = "ok", 200
            row.finish_reason = "length" if n_out else "stop"
            row.t_first_byte_ns = first - 100_000
            row.t_first_token_ns = first if n_out else None
            row.t_last_token_ns = last if n_out else None
            row.t_done_ns = last + 200_000
            row.usage_prompt_tokens = int(in_tokens[i])
            row.usage_completion_tokens = row.client_output_tokens = row.output_tokens = n_out
            row.output_tokens_source = TokenSource.USAGE
            row.output_chars = 4 * n_out
            row.output_sha256 = f"{i:064x}"
            row.num_chunks = n_out
            if spec.kv_memory:
                row.kv_peak_bytes = 4096 * (i + 1)
                row.kv_mean_bytes, row.kv_amortised_bytes = 2048 * (i + 1), 1024 * (i + 1)
                row.kv_unused_bytes, row.temp_peak_bytes = 100, 1000
                row.kv_evicted_tokens = 16 if i == 1 else 0
            chunks.extend((rid, int(t), 1, 4) for t in token_times[:n_out])

    duration_s = max(r.t_done_ns for r in records) / NS_PER_S
    writer = RunWriter(path, RunManifest(**_manifest(spec, path.name, duration_s)))
    writer.write_schedule([(r.request_id, r.t_scheduled_ns / NS_PER_S, False) for r in records])
    writer.append_requests(records)
    writer.append_chunks(chunks)
    writer.close(complete=True)
    # The wall-clock end is part of the golden cards, so it is pinned, not the writer's clock.
    writer.update_manifest(ended_at=f"2026-11-29T10:00:{min(59, int(duration_s) + 1):02d}+00:00")
    if spec.capacity is not None:
        (path / "capacity.json").write_text(json.dumps({"curve": spec.capacity}, indent=2))
    if spec.write_summary:
        import slo

        write_summary(path, RunSummary.from_dict(slo.summarize(path, spec.slo)))
    return path
