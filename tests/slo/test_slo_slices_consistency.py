"""Slices and the Little's-law check on the hand-worked run."""

from __future__ import annotations

import numpy as np
import pytest
from slo_runs import hand_requests, ms, request_metrics

from slo.consistency import littles_law
from slo.errors import SLOError
from slo.slices import in_flight_at_send, slices_summary
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


def test_in_flight_at_dispatch_by_hand():
    """Sends at 0, 102, 200, 330, 400 ms; done at 260, 430, 505, 400, 401 ms. In flight at
    each send: r1 none; r2 r1; r3 r1, r2; r4 r2, r3 (r1 done at 260); r5 r2, r3 (r4 done at
    400, the same instant: not in flight)."""
    rm = request_metrics(*hand_requests())
    assert in_flight_at_send(rm.t_sent_ns, rm.t_done_ns).tolist() == [0, 1, 2, 2, 2]
    never_done = in_flight_at_send(np.array([0.0, 1.0, np.nan]), np.array([np.nan, 2.0, 3.0]))
    assert never_done[:2].tolist() == [0, 1] and np.isnan(never_done[2])


def test_load_slices_with_attainment():
    rm = request_metrics(*hand_requests())
    spec = SLOSpec(name="t", per_request=PerRequestObjectives(ttft_ms=250))
    load = {e["label"]: e for e in slices_summary(rm, spec)["in_flight"]}
    assert list(load) == ["0-0", "1-1", "2-3"]
    assert [load[k]["n"] for k in load] == [1, 1, 3]
    # TTFT r1 100 ms (good), r2 200 ms (good), r3 300 ms (miss), r4/r5 failed
    assert load["2-3"]["attainment"] == 0 and load["1-1"]["attainment"] == 1
    assert load["2-3"]["range"] == [2, 4]


@pytest.mark.parametrize(
    ("width_s", "expected"),
    [
        # dispatch period 0..0.4 s (the last send); the drain to 0.505 s is in no slice
        (0.2, [("0-0.2 s", 2), ("0.2-0.4 s", 3)]),
        (0.15, [("0-0.15 s", 2), ("0.15-0.3 s", 1), ("0.3-0.4 s", 2)]),
        (0.4, [("0-0.4 s", 5)]),  # exactly the span: one slice
        (10.0, [("0-0.4 s", 5)]),  # wider than the span: one slice, cut at the last send
    ],
)
def test_fixed_width_time_slices_exclude_the_drain(width_s, expected):
    rm = request_metrics(*hand_requests())
    spec = SLOSpec(name="t", per_request=PerRequestObjectives(ttft_ms=250))
    time = slices_summary(rm, spec, slice_duration_s=width_s)["time"]
    assert [(e["label"], e["n"]) for e in time] == expected
    first = time[0]
    duration = first["range"][1] - first["range"][0]
    assert first["sent_request_per_s"] == pytest.approx(first["n"] / duration)
    assert sum(e["n"] for e in time) == 5


def test_time_slices_are_only_on_request():
    rm = request_metrics(*hand_requests())
    assert "time" not in slices_summary(rm)
    with pytest.raises(SLOError, match="positive number of seconds"):
        slices_summary(rm, slice_duration_s=0)


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
    with pytest.raises(slo.SLOError, match="positive number of seconds"):
        slo.summarize(hand_run, slice_duration_s=-1.0)
