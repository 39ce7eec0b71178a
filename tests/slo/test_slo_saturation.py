"""Over-saturation: TTFT and the in-flight count rising together is said in words."""

from __future__ import annotations

import numpy as np
import pytest
from slo_runs import ms, request_metrics

from slo.runrecord import OutcomeCounts, RunSummary, Saturation
from slo.saturation import rank_correlation, saturation_summary


def _queue_run(n: int, gap_ms: float, service_ms: float) -> list[dict]:
    """A single-server queue: request i arrives (is sent) at i * gap and is served for
    `service_ms` after the previous one finished; its first token comes when service starts
    plus 5 ms. With service > gap the queue only grows."""
    rows, free_at = [], 0.0
    for i in range(n):
        sent = i * gap_ms
        start = max(sent, free_at)
        done = start + service_ms
        free_at = done
        rows.append(dict(request_id=f"r{i:03d}", t_scheduled_ns=ms(sent), t_sent_ns=ms(sent),
                         t_first_token_ns=ms(start + 5), t_last_token_ns=ms(done),
                         t_done_ns=ms(done), status="ok", input_tokens=8, output_tokens=8,
                         output_tokens_source="usage"))  # fmt: skip
    return rows


def test_a_growing_queue_is_flagged_in_words():
    s = saturation_summary(request_metrics(_queue_run(40, gap_ms=10, service_ms=20), []))
    assert s["judged"] and s["saturated"] is True
    # hand: request i waits i * 10 ms, so TTFT = 5 + 10 i; quarters of 10: medians at
    # i = 4.5 and 34.5 -> 50 and 350 ms; in flight at send i is about i / 2
    assert s["ttft_first_ms"] == pytest.approx(50) and s["ttft_last_ms"] == pytest.approx(350)
    assert s["in_flight_last"] >= 15
    assert s["sentence"].startswith("The target cannot keep up: median TTFT rose from 50 ms")


def test_a_steady_state_is_not_flagged():
    s = saturation_summary(request_metrics(_queue_run(40, gap_ms=20, service_ms=10), []))
    assert s["judged"] and s["saturated"] is False
    assert s["ttft_first_ms"] == pytest.approx(5) and s["ttft_last_ms"] == pytest.approx(5)


@pytest.mark.parametrize("n", [0, 5, 19])
def test_too_few_requests_are_not_judged(n):
    s = saturation_summary(request_metrics(_queue_run(n, gap_ms=10, service_ms=20), []))
    assert s["judged"] is False and s["saturated"] is None
    assert s["sentence"].startswith("not judged")


def test_twenty_requests_are_enough():
    s = saturation_summary(request_metrics(_queue_run(20, gap_ms=10, service_ms=30), []))
    assert s["judged"] and s["saturated"] is True


def test_rank_correlation_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    for _ in range(20):
        x = rng.integers(0, 6, size=30).astype(float)  # ties included
        y = x + rng.normal(0, 2, size=30)
        assert rank_correlation(x, y) == pytest.approx(stats.spearmanr(x, y).statistic)
    assert rank_correlation(np.ones(5), np.arange(5.0)) is None
    assert rank_correlation(np.arange(2.0), np.arange(2.0)) is None


def test_the_run_verdict_says_it_in_words():
    from harness.run.outcome import EXIT_OK, judge

    def summary_of(saturation: dict) -> RunSummary:
        return RunSummary(counts=OutcomeCounts(total=40, by_status={"ok": 40}), error_rate=0.0,
                          saturation=Saturation.from_dict(saturation))  # fmt: skip

    summary = summary_of(saturation_summary(request_metrics(_queue_run(40, 10, 20), [])))
    verdict = judge(summary, stopped_reason=None, stopped_by_errors=False, slo_given=False)
    assert verdict.exit_code == EXIT_OK and verdict.sentence.startswith("The target cannot keep up")
    summary = summary_of(saturation_summary(request_metrics(_queue_run(40, 20, 10), [])))
    assert (
        judge(summary, stopped_reason=None, stopped_by_errors=False, slo_given=False).sentence
        is None
    )
