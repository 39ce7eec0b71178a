"""The typed summary: every block `slo.summarize` writes reads as its `slo.runrecord` section,
and writes back the very JSON it was read from (summary.json does not change); older and
partial summaries read as the readers always read them, an absent key as None."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from slo.runrecord import (
    SCHEDULE_SCHEMA,
    SERVER_METRICS_SCHEMA,
    BatchRates,
    Conventions,
    Distribution,
    FaultWindow,
    Goodput,
    Ledger,
    RequestRecord,
    RequestStatus,
    RunManifest,
    RunRecordError,
    RunSummary,
    RunTables,
    Saturation,
    ServerMetrics,
    Sessions,
    TokenSource,
)
from slo.runrecord.schema import CHUNKS_SCHEMA, columns_table, requests_table
from slo.summary import summarize_tables

MS = 1_000_000
SPEC = {
    "name": "p99",
    "per_request": {"ttft_ms": 200.0, "tpot_ms": 50.0},
    "percentiles": [{"metric": "ttft_ms", "percentile": 99, "max_ms": 200.0}],
    "attainment_min": 0.9,
}


def _request(i: int) -> tuple[RequestRecord, list[tuple]]:
    """Request i of 48: 8 sessions of 6 turns, TTFT rising with i, 2 tokens a chunk on
    every third request, an error every 13th, the last one not sent; outputs checked."""
    rid, sent = f"r{i:02d}", i * 100 * MS
    row = RequestRecord(request_id=rid, session_id=f"s{i % 8}", turn_index=i // 8,
                        t_scheduled_ns=sent, input_tokens=40 + i,
                        usage_prompt_tokens=40 + i, usage_cached_tokens=8 * (i // 8))  # fmt: skip
    if i == 47:
        row.status, row.t_scheduled_ns = RequestStatus.NOT_SENT, None
        return row, []
    row.t_sent_ns = sent
    if i % 13 == 5:
        row.status, row.error_class, row.t_done_ns = RequestStatus.ERROR, "http_5xx", sent + MS
        return row, []
    per_chunk = 2 if i % 3 == 0 else 1
    first = sent + (20 + 4 * i) * MS
    times = [first + k * 10 * MS for k in range(5)]
    row.status, row.t_first_token_ns, row.t_last_token_ns = RequestStatus.OK, times[0], times[-1]
    row.t_done_ns = times[-1] + MS
    row.output_tokens = row.usage_completion_tokens = 5 * per_chunk
    row.output_tokens_source = row.chunk_tokens_source = TokenSource.USAGE
    row.output_exact_match = i % 4 != 1
    row.output_agreement = 1.0 if i % 4 != 1 else 0.5
    row.output_flags = "diverged" if i % 4 == 1 else None
    return row, [(rid, t, per_chunk, 4 * per_chunk) for t in times]


def _tables(*, streamed: bool = True) -> RunTables:
    made = [_request(i) for i in range(48)]
    requests = [r for r, _ in made]
    gauges = [
        (k * 500 * MS, name, "{}", value)
        for k in range(10)
        for name, value in (
            ("vllm:num_requests_running", float(k % 4)),
            ("vllm:kv_cache_usage_perc", k / 20),
            ("vllm:prefix_cache_queries_total", 100.0 * k),
            ("vllm:prefix_cache_hits_total", 40.0 * k),
        )
    ]
    manifest = RunManifest(
        t0_ns=0,
        complete=True,
        slo=SPEC,
        target={"endpoint": "chat", "prompt_overhead_tokens": 0},
        config={"slice_duration_s": 1.0, "diverge_before": 4, "stream": streamed},
        fault_plan={"name": "down", "sha256": "f" * 64,
                    "windows": [{"start_s": 1.0, "end_s": 2.0, "kind": "down"}]},
        server_state={"before": {"running": 0}, "after": {"running": 0, "waiting": 0}},
    )  # fmt: skip
    return RunTables(
        requests=requests_table(requests),
        chunks=columns_table([c for _, cs in made for c in cs], CHUNKS_SCHEMA),
        manifest=manifest,
        server_metrics=columns_table(gauges, SERVER_METRICS_SCHEMA),
        schedule=columns_table(
            [(r.request_id, i / 10, False) for i, r in enumerate(requests)], SCHEDULE_SCHEMA
        ),  # fmt: skip
    )


def _as_written_before(summary: dict) -> str:
    """summary.json as the untyped RunSummary wrote it: top-level keys in field order, every
    block exactly as `slo` built it, `conventions` left out when None."""
    data = {f.name: summary[f.name] for f in fields(RunSummary) if f.name in summary}
    if data.get("conventions", {}) is None:
        del data["conventions"]
    return json.dumps(data, indent=2, default=str) + "\n"


VARIANTS = {
    "rich": (lambda: _tables(), {"conventions": "all"}),
    "not streamed": (lambda: _tables(streamed=False), {"conventions": "all"}),
    "no slo": (lambda: _tables(), {"slo_spec": {"name": "none", "percentiles": []}}),
    "three requests": (
        lambda: RunTables(
            requests=requests_table([_request(i)[0] for i in (0, 1, 2)]),
            chunks=columns_table([c for i in (0, 1, 2) for c in _request(i)[1]], CHUNKS_SCHEMA),
        ),
        {},
    ),  # fmt: skip
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_summary_json_is_the_same_through_the_typed_summary(variant):
    make, options = VARIANTS[variant]
    summary = summarize_tables(make(), **options)
    typed = RunSummary.from_dict(summary)
    assert typed.to_dict() == summary
    assert typed.to_json() == _as_written_before(summary)  # the same bytes, key order too
    assert RunSummary.from_json(typed.to_json()) == typed


def test_every_block_of_a_rich_run_is_typed():
    s = RunSummary.from_dict(summarize_tables(_tables(), conventions="all"))
    assert s.counts.total == 47 and s.counts.not_sent == 1
    assert s.counts.by_error_class == {"http_5xx": 4}
    assert isinstance(s.latency_ms.ttft, Distribution) and s.latency_ms.ttft.n == 43
    assert s.latency_ms.ttft.interval(99) is not None and s.latency_ms.queue.ci is None
    assert s.throughput.attempted_request_per_s == pytest.approx(47 / s.window_s)
    assert isinstance(s.ledger, Ledger) and s.ledger.verdict == "ok" and s.ledger.leak.checked
    assert isinstance(s.saturation, Saturation) and s.saturation.rho_ttft is not None
    assert isinstance(s.sessions, Sessions) and s.sessions.by_turn[0].turn == 0
    assert s.sessions.by_turn[0].ttft_ms.n == 7  # r05 failed
    assert isinstance(s.server_metrics, ServerMetrics)
    assert (
        s.server_metrics.gauges["running"].max == 3.0 and s.server_metrics.gauges["waiting"] is None
    )
    assert s.server_metrics.prefix_cache_hit_rate == pytest.approx(0.4)
    assert s.correctness.n_compared == 43 and s.correctness.flags["diverged"] == 11
    assert [row.bucket for row in s.correctness.by_server_batch] == ["1", "2", "3-4"]
    assert all(isinstance(row, BatchRates) for row in s.correctness.by_server_batch)
    assert s.correctness.by_load[0].bucket == s.correctness.by_load[0].load
    assert isinstance(s.faults.windows[0], FaultWindow) and s.faults.windows[0].kind == "down"
    assert isinstance(s.goodput, Goodput) and s.goodput.total_requests == 47
    assert s.slo.objectives[0].metric == "ttft_ms" and s.slo.verdict == "inconclusive"
    assert [name for name, _ in s.slices.dimensions()] == [
        "input_tokens", "output_tokens", "in_flight", "time"
    ]  # fmt: skip
    assert s.slices.time[0].sent_request_per_s is not None
    assert s.chunking.tokens_per_chunk.max == 2.0 and s.chunking.source == TokenSource.USAGE
    assert s.little_law.peak_in_flight >= 1 and s.prompt_tokens.verdict == "agree"
    assert isinstance(s.conventions, Conventions) and s.conventions.undefined is None
    assert s.conventions.tools["vllm"].metrics["tpot"].definition


def test_a_non_streamed_run_says_why_it_has_no_conventions():
    s = RunSummary.from_dict(summarize_tables(_tables(streamed=False), conventions="all"))
    assert s.conventions.tools == {} and "not streamed" in s.conventions.undefined
    assert s.conventions.to_dict() == {"undefined": s.conventions.undefined}


def test_an_older_summary_reads_absent_blocks_and_keys_as_none():
    old = RunSummary.from_dict({"schema_version": 1, "counts": {"total": 3}, "ledger": None})
    assert old.counts.total == 3 and old.counts.not_sent is None and old.counts.by_status is None
    assert old.throughput.request_per_s is None and old.latency_ms.ttft is None
    assert old.ledger is None and old.sessions is None and old.slices.dimensions() == []
    written = old.to_dict()
    assert written["counts"] == {"total": 3} and written["throughput"] == {}
    assert "conventions" not in written


def test_a_section_writes_back_only_the_keys_it_was_read_with():
    judged_too_early = {"judged": False, "saturated": None, "sentence": "not judged", "n": 3,
                        "rule": "r"}  # fmt: skip
    assert Saturation.from_dict(judged_too_early).to_dict() == judged_too_early
    assert Saturation(judged=True).to_dict()["rho_ttft"] is None  # built in code: every key
    assert Distribution.from_dict([1, 2]) is None and Ledger.from_dict(None) is None
    assert Distribution.from_dict({"ci": {"p99": [1, None]}}).interval(99) is None
    assert Distribution.from_dict({"ci": {"p50": [1, 2]}}).interval(50) == [1.0, 2.0]


def test_the_summary_document_stays_strict_at_the_top():
    with pytest.raises(RunRecordError, match="does not know \\(zzz\\)"):
        RunSummary.from_dict({"schema_version": 1, "zzz": 1})
