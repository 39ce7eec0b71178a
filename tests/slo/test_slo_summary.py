"""Hand-worked summary of the five-request run in slo_runs.hand_requests."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from slo_runs import ms, write_run

import slo
from slo import SLOError

WINDOW_S = 0.505  # first send 0 ms, last done 505 ms (r3)


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


def test_counts_and_error_rate(hand_run):
    s = slo.summarize(hand_run)
    assert s["counts"]["total"] == 5
    assert s["counts"]["by_status"] == {
        "ok": 3, "error": 1, "timeout": 0, "cancelled": 0, "rejected": 1, "unknown": 0
    }  # fmt: skip
    assert s["counts"]["by_error_class"] == {"http_5xx": 1, "rejected_429": 1}
    assert s["error_rate"] == approx(2 / 5)


def test_window_and_throughput(hand_run):
    s = slo.summarize(hand_run)
    assert s["window_s"] == approx(WINDOW_S)
    t = s["throughput"]
    assert t["request_per_s"] == approx(3 / WINDOW_S)  # ok requests only
    assert t["attempted_request_per_s"] == approx(5 / WINDOW_S)
    assert t["input_tokens_per_s"] == approx((10 + 20 + 30) / WINDOW_S)
    assert t["output_tokens_per_s"] == approx((4 + 2 + 1) / WINDOW_S)
    assert t["total_tokens_per_s"] == approx(67 / WINDOW_S)


def test_ttft_over_ok_requests(hand_run):
    ttft = slo.summarize(hand_run)["latency_ms"]["ttft"]
    ci = ttft.pop("ci")
    # ok TTFTs: 100, 200, 300. p90 at h = 2 * 0.9 = 1.8 -> 200 + 0.8 * 100.
    assert ttft == {
        "mean": approx(200), "p50": approx(200), "p90": approx(280), "p95": approx(290),
        "p99": approx(298), "max": approx(300), "n": 3,
    }  # fmt: skip
    # bootstrap intervals of a percentile of {100, 200, 300} lie within the sample's range
    for q in ("p50", "p90", "p99"):
        low, high = ci[q]
        assert 100 <= low <= ttft[q] <= high <= 300


def test_intervals_are_seeded(hand_run):
    a = slo.summarize(hand_run, seed=3)["latency_ms"]
    assert a == slo.summarize(hand_run, seed=3)["latency_ms"]
    assert a["itl_request_mean"].get("ci") is None  # intervals only on ttft, tpot, itl, e2e


def test_tpot_skips_one_token_outputs(hand_run):
    tpot = slo.summarize(hand_run)["latency_ms"]["tpot"]
    # r1: (250 - 100) / 3 = 50; r2: (422 - 302) / 1 = 120; r3 has one token: undefined.
    assert tpot["n"] == 2
    assert tpot["mean"] == approx(85)
    assert tpot["p50"] == approx(85)
    assert tpot["p90"] == approx(50 + 0.9 * 70)
    assert tpot["max"] == approx(120)


def test_itl_pooled_and_per_request(hand_run):
    lat = slo.summarize(hand_run)["latency_ms"]
    # r1 gaps 50, 100 (the 2-token chunk is one gap); r2 gap 120 (role chunk skipped).
    assert lat["itl"]["n"] == 3
    assert lat["itl"]["mean"] == approx(90)
    assert lat["itl"]["p50"] == approx(100)
    assert lat["itl"]["p90"] == approx(116)  # h = 1.8 between 100 and 120
    assert lat["itl"]["max"] == approx(120)
    assert lat["itl_request_mean"]["n"] == 2
    assert lat["itl_request_mean"]["mean"] == approx((75 + 120) / 2)
    assert lat["itl_max"]["n"] == 2
    assert lat["itl_max"]["p50"] == approx(110)


def test_e2e_over_ok_requests(hand_run):
    e2e = slo.summarize(hand_run)["latency_ms"]["e2e"]
    # 260, 328, 305 -> sorted 260, 305, 328
    assert e2e["n"] == 3
    assert e2e["mean"] == approx((260 + 328 + 305) / 3)
    assert e2e["p50"] == approx(305)
    assert e2e["p90"] == approx(305 + 0.8 * 23)
    assert e2e["max"] == approx(328)


def test_dispatch_lag_and_client_bound(hand_run):
    s = slo.summarize(hand_run)
    # lags 0, 2, 0, 30, 0 -> sorted 0, 0, 0, 2, 30; p99 at h = 3.96.
    assert s["dispatch_lag_ms"] == {
        "p50": approx(0), "p99": approx(2 + 0.96 * 28), "max": approx(30), "n": 5
    }  # fmt: skip
    assert s["client_bound"] is True
    assert slo.summarize(hand_run, client_bound_ms=30.0)["client_bound"] is False


def _capped(rid: str, scheduled: float, freed: float | None, sent: float) -> dict:
    return dict(request_id=rid, t_scheduled_ns=ms(scheduled), t_slot_freed_ns=ms(freed),
                t_sent_ns=ms(sent), t_first_token_ns=ms(sent + 50), t_last_token_ns=ms(sent + 50),
                t_done_ns=ms(sent + 51), status="ok", input_tokens=8, output_tokens=1,
                output_tokens_source="usage")  # fmt: skip


def test_waiting_for_a_concurrency_cap_slot_is_queueing_not_dispatch_lag(tmp_path):
    """Cap 2, all due at 0: c and d waited for the slots a and b freed at 51 and 52 and went
    0.5 and 1 ms after; lag runs from the later of the scheduled and freed times."""
    rows = [_capped("a", 0, None, 0), _capped("b", 0, None, 0.5),
            _capped("c", 0, 51, 51.5), _capped("d", 0, 52, 53)]  # fmt: skip
    s = slo.summarize(write_run(tmp_path / "run", rows, []))
    # lags 0, 0.5, 0.5, 1 -> p50 0.5, p99 at h = 2.97: 0.5 + 0.97 * 0.5
    assert s["dispatch_lag_ms"] == {
        "p50": approx(0.5), "p99": approx(0.5 + 0.97 * 0.5), "max": approx(1), "n": 4
    }  # fmt: skip
    assert s["client_bound"] is False
    assert s["latency_ms"]["queue"]["max"] == approx(53)  # scheduled to sent, cap included


def test_a_late_dispatch_is_still_client_bound_with_a_cap(tmp_path):
    """The negative control: e's slot was freed at 10, before it was due at 40, and it went
    at 70 (30 ms late); f's slot freed at 100 and it went at 125 (25 ms late); g was on time.
    Neither cap nor schedule held them: the load generator did."""
    rows = [_capped("e", 40, 10, 70), _capped("f", 60, 100, 125), _capped("g", 0, None, 0)]
    s = slo.summarize(write_run(tmp_path / "run", rows, []))
    # lags 30, 25, 0 -> sorted 0, 25, 30; p99 at h = 1.98: 25 + 0.98 * 5
    assert s["dispatch_lag_ms"] == {
        "p50": approx(25), "p99": approx(25 + 0.98 * 5), "max": approx(30), "n": 3
    }  # fmt: skip
    assert s["client_bound"] is True


def test_output_tokens_source_recorded(hand_run):
    s = slo.summarize(hand_run)
    assert s["output_tokens_source"] == "mixed"
    assert s["output_tokens_source_counts"] == {"chunk_count": 1, "usage": 2}


def _sourced(rid: str, status: str, output_tokens: int | None, source: str | None) -> dict:
    return dict(request_id=rid, t_scheduled_ns=ms(0), t_sent_ns=ms(0), t_done_ns=ms(10),
                status=status, output_tokens=output_tokens,
                output_tokens_source=source)  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "label", "counts"),
    [
        # rejected and failed before any output: the client counted nothing, no second source
        ([_sourced("a", "ok", 4, "usage"), _sourced("b", "rejected", 0, "chunk_count"),
          _sourced("c", "error", 0, "chunk_count"), _sourced("d", "ok", 0, "usage")],
         "usage", {"usage": 1}),
        # cut after some output: its tokens were counted by the client, a genuine mix
        ([_sourced("a", "ok", 4, "usage"), _sourced("b", "unknown", 2, "tokenizer"),
          _sourced("c", "rejected", 0, "chunk_count")],
         "mixed", {"tokenizer": 1, "usage": 1}),
        # nothing had output: no source at all
        ([_sourced("a", "rejected", 0, "chunk_count"), _sourced("b", "timeout", None, None)],
         None, {}),
    ],
)  # fmt: skip
def test_token_sources_count_only_requests_with_output(tmp_path, rows, label, counts):
    s = slo.summarize(write_run(tmp_path / "run", rows, []))
    assert (s["output_tokens_source"], s["output_tokens_source_counts"]) == (label, counts)


def test_summary_is_json_serialisable(hand_run):
    s = slo.summarize(hand_run)
    assert json.loads(json.dumps(s, allow_nan=False)) == s


def test_empty_run_has_undefined_metrics(tmp_path):
    run = write_run(tmp_path / "empty", [], [])
    s = slo.summarize(run)
    assert s["counts"]["total"] == 0
    assert s["window_s"] is None
    assert s["throughput"]["request_per_s"] is None
    assert s["latency_ms"]["ttft"] == {
        "mean": None, "p50": None, "p90": None, "p95": None, "p99": None, "max": None, "n": 0,
        "ci": {"p50": None, "p90": None, "p99": None},
    }  # fmt: skip
    assert s["error_rate"] is None
    assert s["client_bound"] is False


def test_all_failed_run_keeps_failures_in_counts(tmp_path):
    rows = [
        dict(request_id=f"f{i}", t_scheduled_ns=ms(i), t_sent_ns=ms(i), t_done_ns=ms(i + 5),
             status="timeout", error_class="timeout", input_tokens=8)
        for i in range(4)
    ]  # fmt: skip
    s = slo.summarize(write_run(tmp_path / "failed", rows, []))
    assert s["counts"]["by_status"]["timeout"] == 4
    assert s["error_rate"] == 1.0
    assert s["throughput"]["request_per_s"] == 0.0
    assert s["throughput"]["attempted_request_per_s"] == approx(4 / 0.008)
    assert s["latency_ms"]["e2e"]["n"] == 0


def test_warmup_rows_are_excluded(tmp_path):
    rows = [
        dict(request_id="w", is_warmup=True, t_sent_ns=ms(0), t_done_ns=ms(1000), status="ok"),
        dict(request_id="a", t_sent_ns=ms(10), t_done_ns=ms(20), status="ok"),
    ]
    s = slo.summarize(write_run(tmp_path / "warm", rows, []))
    assert s["counts"]["total"] == 1
    assert s["window_s"] == approx(0.010)


def test_missing_run_dir_is_one_sentence(tmp_path):
    with pytest.raises(SLOError, match="has no requests.parquet"):
        slo.summarize(tmp_path / "nope")


def test_one_token_tpot_is_nan_not_zero():
    tpot = slo.metrics.tpot_ms([0.0, 0.0], [0.0, 4e6], [1, 3])
    assert math.isnan(tpot[0])
    assert tpot[1] == approx(2.0)


def test_run_complete_little_law_and_slices_in_summary(tmp_path):
    from slo_runs import hand_requests

    requests, chunks = hand_requests()
    run = write_run(tmp_path / "partial", requests, chunks, {"complete": False})
    s = slo.summarize(run)
    assert s["run_complete"] is False
    assert s["little_law"]["mean_in_flight"] == approx(964 / 505)
    assert s["little_law"]["ratio"] == approx(1.0)
    assert set(s["slices"]) == {"input_tokens", "output_tokens", "in_flight"}
    assert [e["label"] for e in s["slices"]["input_tokens"]] == ["0-127"]
    # in flight at each send: 0, 1, 2, 2, 2
    assert [e["n"] for e in s["slices"]["in_flight"]] == [1, 1, 3]
    # the run's own --slice-duration (recorded in its config) adds time slices
    timed = write_run(tmp_path / "timed", requests, chunks, {"config": {"slice_duration_s": 0.2}})
    assert [e["n"] for e in slo.summarize(timed)["slices"]["time"]] == [2, 3]


def test_spec_recorded_in_the_manifest_is_used(tmp_path):
    from slo_runs import hand_requests

    requests, chunks = hand_requests()
    spec = slo.load_slo("interactive").to_dict()
    run = write_run(tmp_path / "with-slo", requests, chunks, {"slo": spec})
    s = slo.summarize(run)
    assert s["slo"]["spec"] == spec
    # interactive limits 450 ms TTFT, 40 ms TPOT: r1 (TPOT 50) and r2 (TPOT 120) miss, r3 has
    # one token (TPOT vacuous) and is good, the two failures miss
    assert s["goodput"]["attainment"] == approx(1 / 5)
    assert s["goodput"]["misses"] == {"not_ok": 2, "ttft_ms": 0, "tpot_ms": 2}
    assert slo.summarize(run, "p99")["slo"]["spec"]["name"] == "p99"


def test_outcome_counts_keep_every_request():
    counts = slo.metrics.outcome_counts(
        np.array(["ok", None, "weird", "error"], dtype=object),
        np.array([None, None, None, "http_5xx"], dtype=object),
    )
    assert counts["total"] == 4
    assert counts["by_status"]["unknown"] == 1 and counts["by_status"]["weird"] == 1
    assert sum(counts["by_status"].values()) == 4
    assert counts["by_error_class"] == {"http_5xx": 1}


def test_rows_without_any_times_stay_json_clean(tmp_path):
    rows = [dict(request_id="a", status="unknown"), dict(request_id="b", status="cancelled")]
    s = slo.summarize(write_run(tmp_path / "blank", rows, []), "p99", conventions="all")
    json.dumps(s, allow_nan=False)
    assert s["counts"]["total"] == 2 and s["window_s"] is None
    assert s["goodput"]["attainment"] == 0 and s["goodput"]["request_per_s"] is None
    assert s["little_law"]["mean_in_flight"] is None
    assert [e["label"] for e in s["slices"]["in_flight"]] == ["unknown"]  # never sent


def test_dispatch_lag_by_hand_with_and_without_a_slot_time():
    from slo.metrics import dispatch_lag_ms

    ms = 1_000_000
    scheduled = np.array([0, 10, 20, 30]) * ms
    sent = np.array([1, 60, 25, np.nan]) * ms
    freed = np.array([np.nan, 58, 5, 40]) * ms  # no cap; freed late; freed early; never sent
    assert dispatch_lag_ms(scheduled, sent).tolist()[:3] == [1.0, 50.0, 5.0]
    lag = dispatch_lag_ms(scheduled, sent, freed)
    # 1 - 0; 60 - max(10, 58); 25 - max(20, 5); not sent: undefined
    assert lag[:3].tolist() == [1.0, 2.0, 5.0] and np.isnan(lag[3])
