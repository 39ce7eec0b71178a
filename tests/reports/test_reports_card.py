"""The card model and its JSON form, against a golden file and hand-counted facts.

Regenerate the golden file after an intended change (and review the diff):

    UPDATE_GOLDEN=1 python -m pytest -q tests/reports/test_reports_card.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rundir_builder import GOLDEN_SPEC, SyntheticRun, write_run

import slo
from reports.build import build_card, kv_cache_text, read_capacity
from reports.card import CARD_SCHEMA_VERSION
from reports.errors import ReportError
from reports.html import render_html
from reports.memory_view import ESTIMATED_SOURCE, REPORTED_SOURCE
from slo.runrecord import write_server_metrics

NS = 1_000_000_000

GOLDEN = Path(__file__).parent / "golden" / "card.json"


def test_json_card_matches_golden(golden_run):
    text = build_card(golden_run).to_json()
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert GOLDEN.is_file(), "no golden file: run with UPDATE_GOLDEN=1 once and review it"
    assert text == GOLDEN.read_text()


def test_json_card_is_repeatable_and_versioned(golden_run):
    first = build_card(golden_run).to_json()
    assert build_card(golden_run).to_json() == first
    data = json.loads(first)
    assert data["schema_version"] == CARD_SCHEMA_VERSION
    assert data["kind"] == "run"
    assert list(data)[:4] == ["schema_version", "kind", "run_id", "headline"]


def test_failure_taxonomy_counts_each_request_once(golden_run):
    # GOLDEN_SPEC: 9 failed requests of known kinds and 2 ok requests with empty output.
    failures = build_card(golden_run).failures
    assert (failures.rejected, failures.timeout, failures.oom) == (3, 2, 1)
    assert (failures.cancelled, failures.unknown, failures.error) == (1, 1, 1)
    assert failures.wrong_output == 2
    assert failures.ok == GOLDEN_SPEC.n_requests - 11
    assert failures.failed == 11 and failures.total == GOLDEN_SPEC.n_requests


def test_card_figures_are_slo_figures(golden_run):
    card = build_card(golden_run)
    summary = slo.summarize(golden_run)
    for row in card.latency:
        dist = summary["latency_ms"][row.metric]
        assert (row.n, row.p50_ms, row.p99_ms) == (dist["n"], dist["p50"], dist["p99"])
        assert row.p99_ci_ms[0] <= row.p99_ms <= row.p99_ci_ms[1]
    rates = {t.name: t.value for t in card.throughput}
    assert rates == {k: v for k, v in summary["throughput"].items() if k in rates}
    assert card.goodput.request_per_s == summary["goodput"]["request_per_s"]
    assert [v.verdict for v in card.slo_verdicts] == [
        o["verdict"] for o in summary["slo"]["objectives"]
    ]
    assert card.headline == summary["slo"]["verdict"]
    assert card.client_health.dispatch_lag_p99_ms == summary["dispatch_lag_ms"]["p99"]
    assert {s.dimension for s in card.slices} == {"input_tokens", "output_tokens", "in_flight"}


def test_series_carry_fault_windows_and_capacity(golden_run):
    series = build_card(golden_run).series
    assert series.fault_windows == [{"start_s": 4.0, "end_s": 6.0, "kind": "latency"}]
    assert [p["rate"] for p in series.capacity] == [2.0, 4.0, 8.0, 16.0]
    assert sum(row["timeout"] for row in series.failures_over_time) == 2
    assert sum(row["ok"] for row in series.failures_over_time) == GOLDEN_SPEC.n_requests - 11
    assert series.cdf_ms["ttft"][-1][1] == 1.0


def test_environment_comes_from_the_manifest(golden_run):
    env = build_card(golden_run).environment
    assert (env.engine, env.model, env.workload_sha256) == ("engine_ref", "tiny-random", "a" * 64)
    assert env.command_line.startswith("bench run")
    assert env.hardware["cpu_count"] == 2


@pytest.mark.parametrize(
    "content",
    [
        [
            {"rate": 4, "attainment": 0.9, "goodput": 3.5},
            {"rate": 2, "attainment": 1, "goodput": 2},
        ],
        {
            "curve": [
                {"rate": 2, "attainment": 1, "goodput": 2},
                {"rate": 4, "attainment": 0.9, "goodput": 3.5},
            ]
        },
        {
            "capacity_rate_per_s": 2,
            "curve_points": [
                {"rate_per_s": 2, "attainment": 1, "goodput_per_s": 2},
                {"rate_per_s": 4, "attainment": 0.9, "goodput_per_s": 3.5},
            ],
        },
    ],
)
def test_capacity_file_layouts(tmp_path, content):
    (tmp_path / "capacity.json").write_text(json.dumps(content))
    assert read_capacity(tmp_path) == [
        {"rate": 2, "attainment": 1, "goodput": 2},
        {"rate": 4, "attainment": 0.9, "goodput": 3.5},
    ]


def test_incomplete_run_without_slo_says_so(tmp_path):
    run = write_run(tmp_path / "r", SyntheticRun(n_requests=30, slo=None, write_summary=False))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest.update(complete=False, interrupted_reason="SIGINT")
    (run / "manifest.json").write_text(json.dumps(manifest))
    card = build_card(run)
    assert card.headline == "no_slo" and card.slo_verdicts == [] and card.goodput is None
    assert any("incomplete (SIGINT)" in note for note in card.notes)


def test_memory_per_request_when_the_target_reports_it(tmp_path):
    """Rows written by the production writer with the usage.kv_memory fields: 20 ok requests,
    peak (i + 1) x 4,096 bytes, so p50 = 10.5 x 4,096 and max 20 x 4,096; one had 16 tokens
    evicted. Without the fields and without /metrics, the section says why it is empty."""
    run = write_run(tmp_path / "r", SyntheticRun(n_requests=20, kv_memory=True))
    memory = build_card(run).memory
    assert memory.available and memory.source == REPORTED_SOURCE
    assert memory.per_request_bytes["max"] == 20 * 4096.0
    assert memory.per_request_bytes["p50"] == pytest.approx(10.5 * 4096.0)
    rows = {r["label"]: r for r in memory.rows}
    assert rows["KV amortised (shared blocks / sharers)"]["max"] == 20 * 1024.0
    assert rows["KV slots unused (fragmentation)"]["p50"] == 100.0
    assert memory.note.startswith("1 request(s) had context evicted lossily (16 tokens")
    html = render_html(build_card(run))
    assert "KV held, token-weighted mean" in html and "evicted lossily" in html
    absent = build_card(write_run(tmp_path / "s", SyntheticRun(n_requests=20))).memory
    assert not absent.available and "reports no memory per request" in absent.reason


def test_memory_is_estimated_from_the_kv_gauge_and_said_to_be(tmp_path):
    """A target that exports only kv_cache_usage_perc and num_requests_running: scrapes at
    (usage 0.5, 2 running), (0.3, 3), (0.2, 0 running: skipped) give shares 0.25 and 0.1;
    without the pool's bytes no byte row. Negative control: no running gauge, no estimate."""
    run = write_run(tmp_path / "r", SyntheticRun(n_requests=10, write_summary=False))
    samples = [(1, 0.5, 2), (2, 0.3, 3), (3, 0.2, 0)]
    rows = [(t * NS, "vllm:kv_cache_usage_perc", "", u) for t, u, _ in samples]
    write_server_metrics(
        run, rows + [(t * NS, "vllm:num_requests_running", "", r) for t, _, r in samples]
    )
    memory = build_card(run).memory
    assert memory.available and memory.source == ESTIMATED_SOURCE
    (row,) = memory.rows
    assert row["unit"] == "share" and row["n"] == 2 and row["max"] == pytest.approx(0.25)
    assert row["p50"] == pytest.approx(0.175) and "An estimate from 2 scrapes" in memory.note
    other = write_run(tmp_path / "s", SyntheticRun(n_requests=10, write_summary=False))
    write_server_metrics(other, rows)
    assert not build_card(other).memory.available


def test_missing_run_directory_is_a_report_error(tmp_path):
    with pytest.raises(ReportError, match="no manifest.json"):
        build_card(tmp_path)


def test_capacity_search_directory_reports_the_probe_at_capacity(tmp_path):
    # The layout `bench capacity --out DIR` writes: probe runs and capacity.json beside them.
    for name in ("probe-00-2rps", "probe-01-4rps", "probe-02-3rps"):
        write_run(tmp_path / name, SyntheticRun(n_requests=15, write_summary=False))
    record = {
        "capacity_rate_per_s": 3.0,
        "curve": [
            {"rate_per_s": 2.0, "n_probes": 1, "attainment": 1.0, "goodput_per_s": 2.0},
            {"rate_per_s": 3.0, "n_probes": 1, "attainment": 0.95, "goodput_per_s": 2.8},
            {"rate_per_s": 4.0, "n_probes": 1, "attainment": 0.7, "goodput_per_s": 2.5},
        ],
        "probes": [
            {"rate_per_s": 2.0, "run_dir": "probe-00-2rps", "attainment": 1.0},
            {"rate_per_s": 4.0, "run_dir": "probe-01-4rps", "attainment": 0.7},
            {"rate_per_s": 3.0, "run_dir": "probe-02-3rps", "attainment": 0.95},
        ],
    }
    (tmp_path / "capacity.json").write_text(json.dumps(record))
    card = build_card(tmp_path)
    assert card.run_id == "probe-02-3rps"
    assert card.series.capacity == [
        {"rate": 2.0, "attainment": 1.0, "goodput": 2.0},
        {"rate": 3.0, "attainment": 0.95, "goodput": 2.8},
        {"rate": 4.0, "attainment": 0.7, "goodput": 2.5},
    ]
    assert build_card(tmp_path / "probe-00-2rps").series.capacity == card.series.capacity


def test_chunk_sentence_only_where_tpot_and_itl_are_defined(tmp_path):
    """A non-streamed run's one "chunk" per request is its whole answer: the card does not
    relate ITL to TPOT there, though the summary still counts tokens per chunk."""
    run = write_run(tmp_path / "r", SyntheticRun(n_requests=20))
    assert build_card(run).chunking_sentence().startswith("TPOT is per token, ITL per chunk")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["stream"] = False
    (run / "manifest.json").write_text(json.dumps(manifest))
    card = build_card(run)
    assert card.chunking.tokens_per_chunk.mean is not None
    assert card.chunking_sentence() is None


def test_the_card_and_summary_name_the_kernel_level(golden_run):
    """The manifest's target (what the server's /info said) reaches summary.json's `engine`
    and the card's engine line, in HTML and on the console."""
    from rich.console import Console

    from reports.console import card_renderable
    from reports.html import render_html

    summary = json.loads((golden_run / "summary.json").read_text())
    assert summary["served_by"] == {
        "engine": "engine_ref", "engine_version": "0.1.0", "dtype": "bfloat16",
        "kernels": "avx512-bf16",
    }  # fmt: skip
    card = build_card(golden_run)
    line = "engine_ref 0.1.0 · bfloat16 · kernels: avx512-bf16"
    assert card.environment.engine_line() == line
    assert line in render_html(card)
    console = Console(width=200, record=True)
    console.print(card_renderable(card))
    assert line in console.export_text()


@pytest.mark.parametrize(
    ("config", "text"),
    [
        ({}, None),  # not said: an external engine
        ({"kv_cache_dtype": "auto", "kv_eviction": "none"}, None),  # exact
        ({"kv_cache_dtype": "int8", "kv_eviction": "none"}, "KV int8"),
        (
            {
                "kv_cache_dtype": "auto",
                "kv_eviction": "sinks",
                "kv_sink_tokens": 4,
                "kv_window_tokens": 1024,
            },
            "KV exact dtype, eviction sinks: 4 sink + 1024 window tokens",
        ),
        (
            {
                "kv_cache_dtype": "fp8_e4m3",
                "kv_eviction": "sliding-window",
                "kv_sink_tokens": 4,
                "kv_window_tokens": 64,
            },
            "KV fp8_e4m3, eviction sliding-window: 0 sink + 64 window tokens",
        ),
    ],
)
def test_the_engine_line_names_a_lossy_kv_cache(config, text):
    assert kv_cache_text(config) == text
