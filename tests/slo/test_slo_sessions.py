"""Per-session metrics against hand-worked tables: durations, TTFT by turn, cache hit rates."""

from __future__ import annotations

import pytest

from slo.runrecord import RequestRecord, RequestStatus
from slo.runrecord.schema import requests_table
from slo.sessions import cache_hit_rate, sessions_summary

MS = 1_000_000


def _turn(rid, sid, turn, sent_ms, first_ms, done_ms, prompt, cached, status=RequestStatus.OK):
    return RequestRecord(
        request_id=rid,
        session_id=sid,
        turn_index=turn,
        t_sent_ns=None if sent_ms is None else sent_ms * MS,
        t_first_token_ns=None if first_ms is None else first_ms * MS,
        t_done_ns=None if done_ms is None else done_ms * MS,
        status=status,
        usage_prompt_tokens=prompt,
        usage_cached_tokens=cached,
    )


def test_sessions_summary_hand_worked():
    table = requests_table(
        [
            _turn("a0", "A", 0, 0, 10, 100, 40, 0),
            _turn("a1", "A", 1, 300, 320, 400, 100, 48),
            _turn("b0", "B", 0, 50, 80, 150, 60, 16),
            _turn("b1", "B", 1, 500, None, 600, 120, None, RequestStatus.ERROR),
            _turn("b2", "B", 2, None, None, None, None, None, RequestStatus.NOT_SENT),
            _turn("x", None, None, 0, 5, 9, 10, 10),  # not a session: left out
        ]
    )
    s = sessions_summary(table)
    assert s["sessions"] == 2 and s["complete"] == 1 and s["turns_not_sent"] == 1
    assert s["turns"]["mean"] == pytest.approx(2.5)
    # only A is complete: first send 0 ms to last done 400 ms
    assert s["duration_s"]["n"] == 1 and s["duration_s"]["p50"] == pytest.approx(0.4)
    t0, t1, t2 = s["by_turn"]
    assert (t0["turn"], t0["n"], t0["ok"]) == (0, 2, 2)
    assert t0["ttft_ms"]["p50"] == pytest.approx(20.0)  # 10 and 30 ms
    assert t0["cache_hit_rate"] == pytest.approx(16 / 100)
    assert (t1["n"], t1["ok"], t1["ttft_ms"]["n"]) == (2, 1, 1)
    assert t1["ttft_ms"]["p50"] == pytest.approx(20.0)
    assert t1["cache_hit_rate"] == pytest.approx(48 / 100)  # b1 reports no cached figure
    assert t2["ok"] == 0 and t2["cache_hit_rate"] is None
    assert s["cache_hit_rate"] == pytest.approx((0 + 48 + 16) / (40 + 100 + 60))


def test_no_sessions_no_block():
    assert sessions_summary(requests_table([_turn("x", None, None, 0, 1, 2, 5, 0)])) is None


@pytest.mark.parametrize(
    ("cached", "prompt", "rate"),
    [
        ([], [], None),
        ([0.0], [0.0], None),
        ([float("nan")], [10.0], None),
        ([5.0, 1.0], [10.0, 10.0], 0.3),
    ],
)
def test_cache_hit_rate_edges(cached, prompt, rate):
    assert cache_hit_rate(cached, prompt) == (None if rate is None else pytest.approx(rate))
