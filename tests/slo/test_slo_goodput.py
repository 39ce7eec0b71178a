"""Attainment and goodput: a hand-worked case and slice overrides."""

from __future__ import annotations

import pytest
from slo_runs import hand_requests, request_metrics

import slo
from slo.goodput import good_mask, goodput_summary
from slo.spec import PerRequestObjectives, SliceOverride, SLOSpec

WINDOW_S = 0.505


def spec(**per_request) -> SLOSpec:
    return SLOSpec(name="t", per_request=PerRequestObjectives(**per_request))


def test_hand_worked_goodput():
    rm = request_metrics(*hand_requests())
    s = spec(ttft_ms=250, tpot_ms=100, max_itl_ms=110)
    # r1 meets all; r2 TPOT 120 and stall 120 too slow; r3 TTFT 300 too slow (one token: its
    # TPOT and stall are vacuous); r4, r5 failed.
    assert list(good_mask(rm, s)) == [True, False, False, False, False]
    g = goodput_summary(rm, s, WINDOW_S)
    assert g["attainment"] == pytest.approx(1 / 5)
    assert g["good_requests"] == 1 and g["total_requests"] == 5
    assert g["request_per_s"] == pytest.approx(1 / WINDOW_S)
    assert g["output_tokens_per_s"] == pytest.approx(4 / WINDOW_S)
    assert g["total_tokens_per_s"] == pytest.approx(14 / WINDOW_S)
    assert g["misses"] == {"not_ok": 2, "ttft_ms": 1, "tpot_ms": 1, "max_itl_ms": 1}


def test_e2e_objective_and_no_objectives():
    rm = request_metrics(*hand_requests())
    # E2E: r1 260, r2 328, r3 305
    assert list(good_mask(rm, spec(e2e_ms=300))) == [True, False, False, False, False]
    # no per-request limits: every ok request is good, failures still miss
    assert list(good_mask(rm, spec())) == [True, True, True, False, False]


def test_slice_override_loosens_long_prompts():
    rm = request_metrics(*hand_requests())
    base = PerRequestObjectives(ttft_ms=250, tpot_ms=100, max_itl_ms=110)
    s = SLOSpec(
        name="t",
        per_request=base,
        slices=(SliceOverride("long", PerRequestObjectives(ttft_ms=400), input_tokens=(25, None)),),
    )
    # r3 has 30 input tokens: its TTFT limit becomes 400 ms, so it is now good
    assert list(good_mask(rm, s)) == [True, False, True, False, False]


def test_ok_request_without_ttft_misses_a_ttft_objective():
    rows = [dict(request_id="z", t_sent_ns=0, t_done_ns=5_000_000, status="ok", output_tokens=0)]
    rm = request_metrics(rows, [])
    assert list(good_mask(rm, spec(ttft_ms=1000))) == [False]
    assert list(good_mask(rm, spec(tpot_ms=1))) == [True]


def test_summary_carries_goodput_and_verdicts(hand_run):
    s = slo.summarize(
        hand_run, {"name": "t", "per_request": {"ttft_ms": 250}, "attainment_min": 0.5}
    )
    assert s["goodput"]["attainment"] == pytest.approx(2 / 5)
    (objective,) = s["slo"]["objectives"]
    assert objective["kind"] == "attainment" and objective["measured"] == pytest.approx(0.4)
    assert objective["n"] == 5 and objective["n_bad"] == 3
    # 3 misses of 5 at an allowed 50%: not enough samples to decide at 99%
    assert objective["verdict"] == "inconclusive"
    assert slo.summarize(hand_run)["goodput"] is None
