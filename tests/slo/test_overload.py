"""The `overload` block (`slo.overload`) from `slo.summarize` on run directories written by the
production writer: phases and their kinds, shedding (when, where, how many, why), the latency
and in-flight count per phase, and the recovery time, all worked out by hand below."""

from __future__ import annotations

import numpy as np
import pytest
from slo_runs import ms, write_run
from test_littles_law import staged

import slo
from slo.overload import OverloadRecovery, rolling_recovery
from slo.runrecord import RunSummary

# An overload run on three stages: base (0, 2 s] at 2/s, peak (2, 4 s] at 8/s, after (4, 9 s] at 2/s.
STAGES = staged((2.0, 2.0), (2.0, 8.0), (5.0, 2.0))
BASE_TTFT = [100, 120, 110, 130]  # b0..b3 sent at 0, 0.5, 1.0, 1.5 s
PEAK_OK = {0: 400, 1: 600, 3: 900, 5: 1200}  # p0..p7 sent at 2.25 + 0.25 k s; the others shed
AFTER_TTFT = [900, 500, 300, 150, 140, 130, 120, 110, 100, 105, 115, 125]  # a_k at 4.4 + 0.4 k s
QUEUE_FULL = "Waiting queue is full (8 requests); retry later."


def ok(rid: str, sent_s: float, ttft_ms: float) -> dict:
    """An ok request: its first token `ttft_ms` after the send, done 200 ms after that."""
    sent = sent_s * 1000
    return dict(request_id=rid, t_scheduled_ns=ms(sent), t_sent_ns=ms(sent),
                t_first_token_ns=ms(sent + ttft_ms), t_last_token_ns=ms(sent + ttft_ms + 150),
                t_done_ns=ms(sent + ttft_ms + 200), status="ok", input_tokens=8,
                output_tokens=4)  # fmt: skip


def shed(rid: str, sent_s: float, message: str | None) -> dict:
    """A request refused with HTTP 429, answered 5 ms after the send."""
    sent = sent_s * 1000
    return dict(request_id=rid, t_scheduled_ns=ms(sent), t_sent_ns=ms(sent),
                t_done_ns=ms(sent + 5), status="rejected", http_status=429,
                error_class="rejected_429", error_message=message, input_tokens=8)  # fmt: skip


def overload_rows(after_ttft: list[float] = AFTER_TTFT) -> list[dict]:
    rows = [ok(f"b{k}", 0.5 * k, t) for k, t in enumerate(BASE_TTFT)]
    for k in range(8):
        sent = 2.25 + 0.25 * k  # p7 at 4.0 s: the peak's last
        message = None if k == 7 else QUEUE_FULL
        rows.append(ok(f"p{k}", sent, PEAK_OK[k]) if k in PEAK_OK else shed(f"p{k}", sent, message))
    rows += [ok(f"a{k}", 4.4 + 0.4 * k, t) for k, t in enumerate(after_ttft)]
    return rows


def overload_of(tmp_path, rows: list[dict], workload: dict | None = STAGES):
    manifest = {"workload": workload} if workload is not None else {}
    run = write_run(tmp_path / "run", rows, [], manifest=manifest)
    return RunSummary.from_dict(slo.summarize(run)).overload


def test_shedding_when_where_how_many_and_why(tmp_path):
    block = overload_of(tmp_path, overload_rows())
    assert (block.phase_source, block.n_sent, block.n_shed) == ("stages", 24, 4)
    assert block.shed_share == pytest.approx(4 / 24)
    assert (block.first_shed_s, block.first_shed_phase) == (2.75, 1)  # p2, the first shed
    assert block.shed_reasons == {QUEUE_FULL: 3, "rejected_429": 1}  # no message: the class
    rows = [(p.phase, p.kind, p.start_s, p.end_s, p.offered_rate_per_s, p.n_sent, p.n_ok,
             p.n_shed, p.shed_share) for p in block.phases]  # fmt: skip
    assert rows == [
        (0, "base", 0.0, 2.0, 2.0, 4, 4, 0, 0.0),
        (1, "peak", 2.0, 4.0, 8.0, 8, 4, 4, 0.5),
        (2, "after_peak", 4.0, 9.0, 2.0, 12, 12, 0, 0.0),
    ]
    assert block.phases[1].shed_reasons == {QUEUE_FULL: 3, "rejected_429": 1}
    assert block.phases[0].shed_reasons == {}


def test_latency_and_in_flight_per_phase(tmp_path):
    base, peak, after = overload_of(tmp_path, overload_rows()).phases
    # base TTFT 100, 110, 120, 130: p50 115, p90 at rank 2.7 = 120 + 0.7 x 10 = 127
    assert (base.latency_ms.ttft.p50, base.latency_ms.ttft.p90) == pytest.approx((115, 127))
    assert base.latency_ms.e2e.max == pytest.approx(330)  # 130 + 200
    assert peak.latency_ms.ttft.n == 4 and peak.latency_ms.ttft.max == pytest.approx(1200)
    # base: all four done inside the phase, in flight 0.30 + 0.32 + 0.31 + 0.33 s over 2 s
    assert base.little_law.mean_in_flight == pytest.approx(1.26 / 2)
    assert base.little_law.predicted_in_flight == pytest.approx(2.0 * 0.315)
    assert base.little_law.ratio == pytest.approx(1.0)
    # peak: lambda = 8 / 2 s = 4/s; W = (0.6 + 0.8 + 1.1 + 1.4 + 4 x 0.005) / 8 = 0.49 s;
    # L = (p0 0.6 + p1 0.8 + p3 and p5 cut at 4 s: 1.0 + 0.5 + p2, p4, p6: 3 x 0.005; p7,
    # sent at 4.0 s, is in flight after the phase) / 2 s = 1.4575
    little = peak.little_law
    assert little.arrival_rate_per_s == pytest.approx(4.0)
    assert little.mean_time_in_system_s == pytest.approx(0.49)
    assert little.mean_in_flight == pytest.approx(1.4575)
    assert little.ratio == pytest.approx(1.4575 / 1.96)
    assert little.peak_in_flight == 3  # e.g. p0, p1 and p2 at 2.75 s
    # after: lambda = 12 / 5 s; W = mean TTFT 2795 / 12 ms + 200 ms; L = (p3's last 0.1 s, p5's
    # 0.9 s, p7's 0.005 s + the a's 2.795 + 12 x 0.2 s, less a11's 0.125 s after 9 s) / 5 s
    little = after.little_law
    w_s = (2795 / 12 + 200) / 1000
    assert little.arrival_rate_per_s == pytest.approx(2.4)
    assert little.mean_time_in_system_s == pytest.approx(w_s)
    assert little.mean_in_flight == pytest.approx(6.075 / 5)
    assert little.ratio == pytest.approx((6.075 / 5) / (2.4 * w_s))


def test_recovery_after_the_peak(tmp_path):
    block = overload_of(tmp_path, overload_rows())
    # the level: base TTFT p90 127 ms, threshold 127 x 1.5 = 190.5 ms. Windows of 8 after 4 s:
    # a0-a7 p90 620, a1-a8 360, a2-a9 195 (just above), a3-a10 143 (a4-a11 133): back from a3,
    # sent at 5.6 s.
    assert (block.base_ttft_p90_ms, block.recovery_threshold_ms) == pytest.approx((127, 190.5))
    assert (block.recovery_window_requests, block.recovery_tolerance) == (8, 0.5)
    assert block.peak_end_s == 4.0
    assert block.recovery == "recovered"
    assert block.recovery_s == pytest.approx(1.6)


# Windows of 8 over these: [300, 200, 200, 100 x 5] p90 230; [200, 200, 100 x 6] exactly 200
# (its two largest are equal); [200, 100 x 7] 130.
ROLLING_TTFT = [300, 200, 200, 100, 100, 100, 100, 100, 100, 100]


@pytest.mark.parametrize(
    ("threshold_ms", "recovery_s", "judged"),
    [
        (200.0, 0.4, OverloadRecovery.RECOVERED),  # at the second window's p90: that one counts
        (199.999, 0.8, OverloadRecovery.RECOVERED),  # just below it: the third window
        (130.0, 0.8, OverloadRecovery.RECOVERED),
        (129.999, None, OverloadRecovery.NOT_RECOVERED),  # below every window's p90
    ],
)
def test_rolling_recovery_at_the_threshold(threshold_ms, recovery_s, judged):
    sent = np.array([4e9 + 0.4e9 * k for k in range(len(ROLLING_TTFT))])
    ttft = np.array(ROLLING_TTFT, float)
    got = rolling_recovery(sent, ttft, after_ns=4e9, threshold_ms=threshold_ms)
    assert got[1] is judged
    assert got[0] == (None if recovery_s is None else pytest.approx(recovery_s))


def test_rolling_recovery_goes_by_send_order_and_needs_every_request_served():
    order = [3, 0, 9, 1, 5, 2, 8, 4, 7, 6]  # the same requests, recorded out of order
    sent = np.array([4e9 + 0.4e9 * k for k in order])
    ttft = np.array([ROLLING_TTFT[k] for k in order], float)
    assert rolling_recovery(sent, ttft, after_ns=4e9, threshold_ms=200.0) == (
        pytest.approx(0.4), OverloadRecovery.RECOVERED
    )  # fmt: skip
    ttft[order.index(1)] = np.nan  # the second request not served: the windows holding it fail
    assert rolling_recovery(sent, ttft, after_ns=4e9, threshold_ms=200.0) == (
        pytest.approx(0.8), OverloadRecovery.RECOVERED
    )  # fmt: skip


def test_a_request_shed_after_the_peak_holds_the_recovery_back(tmp_path):
    rows = overload_rows()
    a3 = next(k for k, r in enumerate(rows) if r["request_id"] == "a3")
    rows[a3] = shed("a3", 4.4 + 0.4 * 3, QUEUE_FULL)
    # a3 was the first request of the first window back; every window holding it fails, and
    # a4-a11 (p90 133 ms) is the first back: a4 was sent at 6.0 s, 2.0 s after the peak.
    block = overload_of(tmp_path, rows)
    assert (block.recovery, block.recovery_s) == ("recovered", pytest.approx(2.0))
    assert [p.n_shed for p in block.phases] == [0, 4, 1]


def test_not_recovered_within_the_run(tmp_path):
    block = overload_of(tmp_path, overload_rows([900 - 10 * k for k in range(12)]))
    assert (block.recovery, block.recovery_s) == ("not_recovered", None)


@pytest.mark.parametrize(("after", "judged"), [(7, "too_few_after"), (8, "recovered")])
def test_too_few_requests_after_the_peak(tmp_path, after, judged):
    block = overload_of(tmp_path, overload_rows([100.0] * after))
    assert block.recovery == judged
    assert block.recovery_s == (None if after < 8 else pytest.approx(0.4))  # a0, at 4.4 s


def test_a_staged_run_without_shedding_still_has_its_phases(tmp_path):
    rows = [r for r in overload_rows() if r["status"] == "ok"]
    block = overload_of(tmp_path, rows)
    assert (block.n_shed, block.shed_share, block.first_shed_s, block.shed_reasons) == (
        0, 0.0, None, {}
    )  # fmt: skip
    assert [p.n_sent for p in block.phases] == [4, 4, 12]


def test_an_unstaged_run_with_shedding_is_one_phase(hand_run):
    # hand_requests: sends at 0, 102, 200, 330 and 400 ms; r5 (400 ms) was rejected, no message
    block = RunSummary.from_dict(slo.summarize(hand_run)).overload
    assert (block.phase_source, block.recovery, block.recovery_s) == ("run", "no_peak", None)
    (only,) = block.phases
    assert (only.kind, only.start_s, only.end_s, only.n_sent, only.n_shed) == ("run", 0, 0.4, 5, 1)
    assert (block.first_shed_s, block.first_shed_phase) == (0.4, 0)
    # lambda = 5 / 0.4 s; W = (260 + 328 + 305 + 70 + 1) / 5 ms; L = (260 + 298 + 200 + 70) / 400
    assert only.little_law.arrival_rate_per_s == pytest.approx(12.5)
    assert only.little_law.mean_time_in_system_s == pytest.approx(0.1928)
    assert only.little_law.mean_in_flight == pytest.approx(828 / 400)
    assert only.little_law.ratio == pytest.approx((828 / 400) / (12.5 * 0.1928))


def test_a_plain_run_has_no_overload_block(tmp_path):
    rows = [r for r in overload_rows() if r["status"] == "ok"]
    assert overload_of(tmp_path, rows, workload=None) is None
    poisson = {"parameters": {"effective": {"arrivals": {"process": "poisson", "rate": 2.0}}}}
    assert overload_of(tmp_path / "p", rows, workload=poisson) is None


def test_a_staged_run_that_never_rises_has_no_peak(tmp_path):
    rows = [r for r in overload_rows() if r["status"] == "ok"]
    block = overload_of(tmp_path, rows, workload=staged((2.0, 2.0), (2.0, 2.0), (5.0, 1.0)))
    assert [p.kind for p in block.phases] == ["base", "base", "base"]
    assert (block.recovery, block.peak_end_s) == ("no_peak", None)
