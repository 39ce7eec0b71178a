"""Slices and the Little's-law check on the hand-worked run."""

from __future__ import annotations

import pytest
from slo_runs import hand_requests, ms, request_metrics

from slo.consistency import littles_law
from slo.slices import slices_summary
from slo.spec import PerRequestObjectives, SLOSpec


def by_label(entries):
    return {e["label"]: e for e in entries}


def test_length_buckets():
    rm = request_metrics(*hand_requests())
    s = slices_summary(rm, input_edges=(0, 25, 45), output_edges=(0, 2))
    inputs = by_label(s["input_tokens"])
    assert list(inputs) == ["0-24", "25-44", "45+"]
    assert inputs["0-24"]["n"] == 2 and inputs["0-24"]["error_rate"] == 0
    assert inputs["0-24"]["latency_ms"]["ttft"]["mean"] == pytest.approx(150)
    assert inputs["25-44"]["counts"]["error"] == 1 and inputs["25-44"]["error_rate"] == 0.5
    assert inputs["25-44"]["latency_ms"]["ttft"]["n"] == 1
    assert inputs["45+"]["counts"]["rejected"] == 1 and inputs["45+"]["range"] == [45, None]
    outputs = by_label(s["output_tokens"])
    assert {k: v["n"] for k, v in outputs.items()} == {"0-1": 1, "2+": 2, "unknown": 2}
    assert outputs["2+"]["latency_ms"]["tpot"]["mean"] == pytest.approx(85)


def test_load_phases_with_attainment():
    rm = request_metrics(*hand_requests())
    spec = SLOSpec(name="t", per_request=PerRequestObjectives(ttft_ms=250))
    phases = slices_summary(rm, spec, num_phases=2)["phase"]
    first, second = phases
    # window 0.505 s in two phases of 0.2525 s; sends at 0, 102, 200 | 330, 400 ms
    assert first["range"] == [pytest.approx(0), pytest.approx(0.2525)]
    assert first["n"] == 3 and second["n"] == 2
    assert first["sent_request_per_s"] == pytest.approx(3 / 0.2525)
    assert first["attainment"] == pytest.approx(2 / 3)
    assert first["goodput_request_per_s"] == pytest.approx(2 / 0.2525)
    assert second["attainment"] == 0 and second["goodput_request_per_s"] == 0


def test_littles_law_on_complete_records():
    rm = request_metrics(*hand_requests())
    law = littles_law(rm.t_sent_ns, rm.t_done_ns)
    # in flight: 260 + 328 + 305 + 70 + 1 = 964 ms over a 505 ms window
    assert law["mean_in_flight"] == pytest.approx(964 / 505)
    assert law["peak_in_flight"] == 3  # r2, r3, r4 between 330 and 400 ms
    assert law["arrival_rate_per_s"] == pytest.approx(5 / 0.505)
    assert law["mean_latency_s"] == pytest.approx(0.964 / 5)
    assert law["ratio"] == pytest.approx(1.0)
    assert law["consistent"] is True


def test_littles_law_flags_a_lost_request():
    requests, chunks = hand_requests()
    requests.append(dict(request_id="lost", t_sent_ns=ms(450), status="unknown"))
    rm = request_metrics(requests, chunks)
    law = littles_law(rm.t_sent_ns, rm.t_done_ns)
    # the lost request stays in flight from 450 to 505 ms
    expected = (1019 / 505) / ((6 / 0.505) * (0.964 / 5))
    assert law["ratio"] == pytest.approx(expected)
    assert law["unfinished"] == 1 and law["consistent"] is False


def test_littles_law_over_a_sub_window():
    rm = request_metrics(*hand_requests())
    law = littles_law(rm.t_sent_ns, rm.t_done_ns, window_ns=(0, ms(250)))
    # L = (250 + 148 + 50) / 250; arrivals r1-r3: 12/s; W = (260 + 328 + 305) / 3 ms
    assert law["mean_in_flight"] == pytest.approx(448 / 250)
    assert law["arrival_rate_per_s"] == pytest.approx(12)
    assert law["ratio"] == pytest.approx((448 / 250) / (12 * 0.893 / 3))
    assert law["consistent"] is False


def test_littles_law_counts_a_broken_clock():
    rows = [dict(request_id="a", t_sent_ns=ms(100), t_done_ns=ms(50), status="ok"),
            dict(request_id="b", t_sent_ns=ms(0), t_done_ns=ms(200), status="ok")]  # fmt: skip
    law = littles_law(*(lambda rm: (rm.t_sent_ns, rm.t_done_ns))(request_metrics(rows, [])))
    assert law["negative_latencies"] == 1
    # L = 200/200 (a adds nothing); lambda W = 10/s * 0.075 s
    assert law["ratio"] == pytest.approx(1 / 0.75)


def test_bad_slice_options_are_one_sentence(hand_run):
    import slo

    with pytest.raises(slo.SLOError, match="strictly ascending"):
        slo.summarize(hand_run, input_edges=(0, 10, 10))
    with pytest.raises(slo.SLOError, match="at least 1"):
        slo.summarize(hand_run, num_phases=0)
