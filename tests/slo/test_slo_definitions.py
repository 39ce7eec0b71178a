"""Definitions that hold in every mode: client queueing time is its own metric, and a
non-streaming run has no TTFT, TPOT or ITL (undefined, never 0 or the whole latency)."""

from __future__ import annotations

import pytest
from slo_runs import hand_requests, write_run

import slo


def test_queue_and_ttft_from_scheduled_by_hand(tmp_path):
    """Hand values (ms): queue = sent - scheduled over sent requests r1..r5 = 0, 2, 0, 30, 0;
    TTFT from the schedule over ok r1..r3 = 100 - 0, 302 - 100, 500 - 200."""
    requests, chunks = hand_requests()
    summary = slo.summarize(write_run(tmp_path / "r", requests, chunks))
    queue = summary["latency_ms"]["queue"]
    assert queue["n"] == 5 and queue["max"] == pytest.approx(30.0)
    assert queue["mean"] == pytest.approx(32 / 5) and queue["p50"] == pytest.approx(0.0)
    waited = summary["latency_ms"]["ttft_from_scheduled"]
    assert waited["n"] == 3 and waited["p50"] == pytest.approx(202.0)
    assert waited["mean"] == pytest.approx((100 + 202 + 300) / 3)
    # TTFT itself still runs from the send: r2's is 200 ms, not 202
    assert summary["latency_ms"]["ttft"]["p50"] == pytest.approx(200.0)
    assert summary["streamed"] is True and summary["undefined_metrics"] == {}


def test_streamed_flag_follows_the_manifest(tmp_path):
    requests, chunks = hand_requests()
    run = write_run(tmp_path / "r", requests, chunks, {"config": {"stream": False}})
    summary = slo.summarize(run, conventions="all")
    assert summary["streamed"] is False
    assert set(summary["undefined_metrics"]) >= {"ttft", "tpot", "itl"}
    assert "not streamed" in summary["undefined_metrics"]["tpot"]
    assert "undefined" in summary["conventions"]
