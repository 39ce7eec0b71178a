"""Hypothesis properties of the metric, attainment and goodput functions."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from slo_runs import request_metrics

from slo import metrics
from slo.goodput import good_mask, goodput_summary
from slo.spec import PerRequestObjectives, SLOSpec
from slo.summary import throughput_summary

MS = 1_000_000
STATUSES = ("ok", "ok", "ok", "error", "timeout", "cancelled", "rejected", "unknown")


@st.composite
def runs(draw, min_size=1):
    n = draw(st.integers(min_size, 25))
    rows, chunks = [], []
    for i in range(n):
        rid = f"r{i}"
        status = draw(st.sampled_from(STATUSES))
        sent = draw(st.integers(0, 5_000)) * MS
        if status != "ok" and draw(st.booleans()):
            done = sent + draw(st.integers(0, 2_000)) * MS
            rows.append(dict(request_id=rid, t_sent_ns=sent, t_done_ns=done, status=status,
                             input_tokens=draw(st.integers(1, 500))))  # fmt: skip
            continue
        tokens = draw(st.integers(1, 12))
        first = sent + draw(st.integers(1, 3_000)) * MS
        gaps = draw(st.lists(st.integers(1, 500), min_size=tokens - 1, max_size=tokens - 1))
        times = [first]
        for gap in gaps:
            times.append(times[-1] + gap * MS)
        chunks.extend((rid, t, 1) for t in times)
        done = times[-1] + draw(st.integers(0, 50)) * MS
        rows.append(dict(request_id=rid, t_sent_ns=sent, t_first_token_ns=first,
                         t_last_token_ns=times[-1], t_done_ns=done, status=status,
                         input_tokens=draw(st.integers(1, 500)), output_tokens=tokens))  # fmt: skip
    return rows, chunks


thresholds = st.one_of(st.none(), st.floats(1, 5_000))


def attainment(rm, **limits) -> float:
    spec = SLOSpec(name="p", per_request=PerRequestObjectives(**limits))
    return float(good_mask(rm, spec).mean())


@settings(max_examples=60, deadline=None)
@given(runs(), thresholds, thresholds, thresholds)
def test_goodput_never_exceeds_throughput(run, ttft, tpot, e2e):
    rm = request_metrics(*run)
    window_s = rm.window_s()
    spec = SLOSpec(
        name="p", per_request=PerRequestObjectives(ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e)
    )
    g = goodput_summary(rm, spec, window_s)
    t = throughput_summary(rm, window_s)
    if window_s:
        assert g["request_per_s"] <= t["request_per_s"] + 1e-9
        assert g["output_tokens_per_s"] <= t["output_tokens_per_s"] + 1e-9
    assert g["good_requests"] <= int(rm.is_ok.sum())


@settings(max_examples=60, deadline=None)
@given(runs(), st.sampled_from(["ttft_ms", "tpot_ms", "max_itl_ms", "e2e_ms"]),
       st.floats(1, 5_000), st.floats(0, 5_000))  # fmt: skip
def test_attainment_monotone_in_each_threshold(run, key, limit, extra):
    rm = request_metrics(*run)
    assert attainment(rm, **{key: limit}) <= attainment(rm, **{key: limit + extra})
    assert attainment(rm, **{key: limit + extra}) <= attainment(rm)


@settings(max_examples=60, deadline=None)
@given(runs(), st.data())
def test_a_failed_request_never_raises_attainment(run, data):
    rows, chunks = run
    limits = dict(ttft_ms=data.draw(thresholds), tpot_ms=data.draw(thresholds))
    before = attainment(request_metrics(rows, chunks), **limits)
    # turn one request into a failure
    i = data.draw(st.integers(0, len(rows) - 1))
    failed = [dict(r) for r in rows]
    failed[i]["status"] = data.draw(st.sampled_from(STATUSES[3:]))
    assert attainment(request_metrics(failed, chunks), **limits) <= before
    # add a failed request
    added = rows + [dict(request_id="extra", t_sent_ns=0, t_done_ns=MS, status="error")]
    assert attainment(request_metrics(added, chunks), **limits) <= before


def linear_percentile_by_hand(values: list[float], q: float) -> float:
    ordered = sorted(values)
    h = (len(ordered) - 1) * q / 100
    low = math.floor(h)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (h - low) * (ordered[high] - ordered[low])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=200))
def test_percentiles_monotone_and_match_hand_interpolation(values):
    d = metrics.distribution(np.array(values))
    chain = [d["p50"], d["p90"], d["p95"], d["p99"], d["max"]]
    assert all(a <= b + 1e-9 for a, b in zip(chain, chain[1:], strict=False))
    assert min(values) - 1e-9 <= d["mean"] <= max(values) + 1e-9
    for q in metrics.PERCENTILES:
        assert math.isclose(
            d[f"p{q}"], linear_percentile_by_hand(values, q), rel_tol=1e-9, abs_tol=1e-6
        )
    assert d["n"] == len(values)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**12), st.integers(0, 10**9)), min_size=1, max_size=50))
def test_tpot_undefined_not_zero_for_one_token(pairs):
    first = np.array([float(a) for a, _ in pairs])
    last = first + np.array([float(b) for _, b in pairs])
    tpot = metrics.tpot_ms(first, last, np.ones(len(pairs)))
    assert np.all(np.isnan(tpot))
    assert metrics.distribution(tpot)["n"] == 0


@settings(max_examples=60, deadline=None)
@given(runs())
def test_pooled_itl_counts_one_gap_per_chunk_pair(run):
    rows, chunks = run
    rm = request_metrics(rows, chunks)
    per_request: dict[str, int] = {}
    for rid, _, _ in chunks:
        per_request[rid] = per_request.get(rid, 0) + 1
    assert rm.pooled_itl_ms().size == sum(max(0, c - 1) for c in per_request.values())
