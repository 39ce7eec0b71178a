"""The `bounds` block against figures worked out by hand from SmolLM2-135M's geometry (30 layers,
3 KV heads, head_dim 64, bf16: 2 · 30 · 3 · 64 · 2 = 23,040 bytes per token), on a run written
with the production writer (`slo.runrecord.RunWriter`)."""

from __future__ import annotations

import pytest
from slo_runs import ms, write_run

from reports.bounds_view import bound_rows
from slo import summarize
from slo.runrecord import EnergyCounter, EnergyRecord, RunSummary, write_server_metrics

SMOLLM2_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # K and V, layers, KV heads, head dim, bf16
BLOCK_TOKENS = 16
POOL_BLOCKS = 100
POOL_BYTES = POOL_BLOCKS * BLOCK_TOKENS * SMOLLM2_BYTES_PER_TOKEN  # 36,864,000
GEOMETRY = {
    "num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "kv_cache_dtype": "bfloat16",
    "element_bytes": 2, "kv_bytes_per_token": SMOLLM2_BYTES_PER_TOKEN,
    "block_size": BLOCK_TOKENS, "num_blocks": POOL_BLOCKS, "pool_bytes": POOL_BYTES,
}  # fmt: skip
TARGET = {"kind": "url", "url": "http://127.0.0.1:8000/v1", "kv_geometry": GEOMETRY}


def blocks(n: int) -> int:
    return n * BLOCK_TOKENS * SMOLLM2_BYTES_PER_TOKEN


def run_rows() -> tuple[list[dict], list[tuple]]:
    """Five requests (times in ms; held = prompt + output so far - 1 from the first token):

    r1 ok: prompt 20, output 5; tokens at 100 (1), 110 (2), 120 (2); done 130; peak 24 tokens
       held, engine: 2 blocks.
    r2 ok: prompt 16, output 1; token at 105; done 106; 16 held, engine: 1 block.
    r3 ok: prompt 40, output 9; tokens at 115 (3), 125 (3), 200 (3); done 210; 48 held, 16
       evicted, engine: 2 blocks (below its bound).
    r4 error at 20: no tokens, no KV figure.
    r5 ok without usage (workload 8 in, client 2 out) nor KV figure; tokens at 300, 310.
    """
    requests = [
        dict(request_id="r1", t_sent_ns=ms(0), t_first_token_ns=ms(100), t_last_token_ns=ms(120),
             t_done_ns=ms(130), status="ok", input_tokens=18, usage_prompt_tokens=20,
             usage_completion_tokens=5, output_tokens=5, kv_peak_bytes=blocks(2),
             kv_evicted_tokens=0),
        dict(request_id="r2", t_sent_ns=ms(50), t_first_token_ns=ms(105), t_last_token_ns=ms(105),
             t_done_ns=ms(106), status="ok", input_tokens=16, usage_prompt_tokens=16,
             usage_completion_tokens=1, output_tokens=1, kv_peak_bytes=blocks(1),
             kv_evicted_tokens=0),
        dict(request_id="r3", t_sent_ns=ms(0), t_first_token_ns=ms(115), t_last_token_ns=ms(200),
             t_done_ns=ms(210), status="ok", input_tokens=40, usage_prompt_tokens=40,
             usage_completion_tokens=9, output_tokens=9, kv_peak_bytes=blocks(2),
             kv_evicted_tokens=16),
        dict(request_id="r4", t_sent_ns=ms(10), t_done_ns=ms(20), status="error",
             error_class="http_5xx", http_status=500, input_tokens=12),
        dict(request_id="r5", t_sent_ns=ms(290), t_first_token_ns=ms(300),
             t_last_token_ns=ms(310), t_done_ns=ms(320), status="ok", input_tokens=8,
             output_tokens=2),
    ]  # fmt: skip
    chunks = [
        ("r1", ms(100), 1), ("r1", ms(110), 2), ("r1", ms(120), 2),
        ("r2", ms(105), 1),
        ("r3", ms(115), 3), ("r3", ms(125), 3), ("r3", ms(200), 3),
        ("r5", ms(300), 1), ("r5", ms(310), 1),
    ]  # fmt: skip
    return requests, chunks


def write_bounds_run(tmp_path, *, target=TARGET, gauge=True, **manifest):
    requests, chunks = run_rows()
    run_dir = write_run(tmp_path / "run", requests, chunks, {"target": target, **manifest})
    if gauge:  # the KV gauge scraped at 0, 120 and 250 ms
        write_server_metrics(
            run_dir,
            [(ms(t), "vllm:kv_cache_usage_perc", "{}", v) for t, v in ((0, 0.0), (120, 0.05), (250, 0.01))],
        )  # fmt: skip
    return run_dir


def bounds_of(run_dir, spec=None):
    return RunSummary.from_dict(summarize(run_dir, spec)).bounds


def test_kv_per_request_against_hand_worked_bytes(tmp_path):
    kv = bounds_of(write_bounds_run(tmp_path)).kv_request
    assert kv.bytes_per_token == 23_040 and kv.pool_bytes_per_token == 23_040
    # held tokens 24, 16, 48 (prompt + output - 1); measured 32, 16, 32 slots' worth
    assert kv.n == 3
    assert kv.bound_bytes == 88 * 23_040 == 2_027_520
    assert kv.measured_bytes == 80 * 23_040 == 1_843_200
    assert kv.ratio == pytest.approx(80 / 88)
    per_request = kv.ratio_per_request  # 32/24, 16/16, 32/48
    assert (per_request.n, per_request.p50, per_request.max) == (3, 1.0, pytest.approx(4 / 3))
    assert per_request.mean == pytest.approx((4 / 3 + 1 + 2 / 3) / 3)
    # block rounding alone: ceil(24/16)*16/24 = 4/3, 16/16, 48/48
    assert kv.explained_ratio.max == pytest.approx(4 / 3) and kv.explained_ratio.p50 == 1.0
    assert (kv.below_bound, kv.evicted) == (1, 1)
    assert "block rounding" in kv.why_differs and "scales" in kv.why_differs
    assert "evicted" in kv.why_differs and kv.absent is None


def test_kv_at_the_peak_in_flight_set_against_the_gauge(tmp_path):
    peak = bounds_of(write_bounds_run(tmp_path)).kv_peak
    # held: 100: r1 20 | 105: +r2 16 | 106: -r2 | 110: r1 +2 | 115: r3 42 | 120: r1 +2
    # | 125: r3 +3 -> 20 + 2 + 2 + 42 + 3 = 69 tokens, r1 and r3 in flight
    assert (peak.peak_s, peak.in_flight, peak.tokens_held) == (0.125, 2, 69)
    assert peak.bound_bytes == 69 * 23_040 == 1_589_760
    # scrapes at 0 (nothing held), 120 (66 held: the 125 ms tokens not yet) and 250 ms (none):
    # the gauge at 120 ms is 5% of the 36,864,000-byte pool
    assert peak.sample_s == 0.12 and peak.sample_bound_bytes == 66 * 23_040 == 1_520_640
    assert peak.measured_bytes == pytest.approx(0.05 * 36_864_000) == 1_843_200
    assert peak.ratio == pytest.approx(1_843_200 / 1_520_640)
    assert peak.measured_max_bytes == pytest.approx(1_843_200)
    assert "first token" in peak.approximation and peak.absent is None


def test_no_scrape_while_tokens_were_held_has_no_measured_figure(tmp_path):
    run_dir = write_bounds_run(tmp_path, gauge=False)
    write_server_metrics(
        run_dir, [(ms(t), "vllm:kv_cache_usage_perc", "{}", 0.0) for t in (0, 90, 400)]
    )
    peak = bounds_of(run_dir).kv_peak
    assert peak.bound_bytes == 1_589_760 and peak.measured_bytes is None and peak.ratio is None
    assert "no scrape fell while requests held tokens" in peak.why_differs


def test_littles_law_per_phase_in_the_bounds_block(tmp_path):
    little = bounds_of(write_bounds_run(tmp_path)).little_law
    (phase,) = little.phases  # no stages: one phase, first to last send (0 to 290 ms)
    assert (phase.phase, phase.start_s, phase.end_s) == (0, 0.0, 0.29)
    law = phase.little_law
    # lambda = 5 / 0.29 s; W = (130 + 56 + 210 + 10 + 30) / 5 ms; L = (130 + 56 + 210 + 10) / 290
    assert law.arrival_rate_per_s == pytest.approx(5 / 0.29)
    assert law.mean_time_in_system_s == pytest.approx(0.0872)
    assert law.predicted_in_flight == pytest.approx(5 / 0.29 * 0.0872)
    assert law.mean_in_flight == pytest.approx(406 / 290)
    assert law.ratio == pytest.approx((406 / 290) / (5 / 0.29 * 0.0872))
    assert "lambda" in little.formula and little.absent is None


def test_the_transfer_bound_is_absent_with_its_reason(tmp_path):
    transfer = bounds_of(write_bounds_run(tmp_path)).transfer
    assert transfer.bound_s is None and transfer.measured_s is None
    assert (
        transfer.absent
        == "the target is not a prefill/decode cluster: the run moved no KV between workers"
    )


def test_a_run_that_moved_kv_says_the_link_was_not_measured(tmp_path):
    """Transfers recorded (one request moved 1 byte is enough; 0 bytes is none): the bound is
    still absent, now because nothing measured the link, not because no KV moved."""
    requests, chunks = run_rows()
    for moved, reason in ((0, "the run moved no KV"), (1, "nothing measured the link")):
        rows = [
            dict(r, kv_transfer_bytes=moved) if r["request_id"] == "r1" else r for r in requests
        ]
        run_dir = write_run(tmp_path / f"run{moved}", rows, chunks, {"target": TARGET})
        transfer = bounds_of(run_dir).transfer
        assert transfer.bound_s is None and reason in transfer.absent


def test_a_target_without_geometry_has_the_kv_bounds_absent_with_the_reason(tmp_path):
    bounds = bounds_of(write_bounds_run(tmp_path, target={"url": "http://127.0.0.1:1/v1"}))
    for block in (bounds.kv_request, bounds.kv_peak):
        assert block.bound_bytes is None and "reports no KV geometry" in block.absent
    assert bounds.little_law.phases  # Little's law needs no geometry


@pytest.mark.parametrize(
    ("change", "absent"),
    [({"num_layers": 0}, "no usable num_layers"), ({"element_bytes": 2.0}, "no usable element_bytes")],
)  # fmt: skip
def test_a_malformed_geometry_is_named(tmp_path, change, absent):
    target = {**TARGET, "kv_geometry": {**GEOMETRY, **change}}
    assert absent in bounds_of(write_bounds_run(tmp_path, target=target)).kv_request.absent


def test_without_a_gauge_the_peak_has_its_bound_and_no_measured_figure(tmp_path):
    peak = bounds_of(write_bounds_run(tmp_path, gauge=False)).kv_peak
    assert peak.bound_bytes == 1_589_760 and peak.measured_bytes is None and peak.ratio is None
    assert peak.why_differs == "no measured figure: the run scraped no KV gauge"


def test_a_non_streamed_run_has_no_peak_in_flight_set(tmp_path):
    run_dir = write_bounds_run(tmp_path, config={"stream": False})
    assert "not streamed" in bounds_of(run_dir).kv_peak.absent


def test_the_block_reads_back_as_it_was_written(tmp_path):
    record = EnergyRecord(
        counters=[EnergyCounter(name="rapl:package-0", joules=5.0)], duration_s=1.0
    )
    data = summarize(write_bounds_run(tmp_path, energy=record.to_dict()))
    assert RunSummary.from_dict(data).to_dict()["bounds"] == data["bounds"]


def test_the_card_rows_say_bound_measured_ratio_and_why(tmp_path):
    rows = bound_rows(bounds_of(write_bounds_run(tmp_path)))
    kv, peak, little, transfer = rows
    assert kv.bound == "1.93 MiB (23,040 B a token)" and kv.measured == "1.76 MiB"  # 88, 80 tokens
    assert kv.ratio == "0.909 (per request: p50 1.000, max 1.333)"
    assert kv.why.endswith("1 of 3 requests below their bound, 1 with tokens evicted")
    assert peak.bound.startswith("1.52 MiB (69 tokens, 2 requests, at 0.125 s); at the scrape")
    assert peak.measured == "1.76 MiB (scrape at 0.120 s; run max 1.76 MiB)"
    assert peak.ratio == "1.212"  # 80 / 66
    assert little.figure == "Little's law, phase 0 (0.00-0.29 s)" and little.ratio == "0.931"
    assert transfer.why.startswith("absent: the target is not a prefill/decode cluster")
