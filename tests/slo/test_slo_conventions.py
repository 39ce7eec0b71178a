"""Other tools' TPOT/ITL definitions on the hand-worked run (values worked out by hand)."""

from __future__ import annotations

import numpy as np
import pytest

import slo
from slo.conventions import nearest_rank_percentile, weighted_inverse_cdf_percentile


def test_percentile_methods_by_hand():
    values = np.array([4.0, 1.0, 3.0, 2.0])
    assert nearest_rank_percentile(values, 50) == 3.0  # sorted[floor(4 * 0.5)]
    assert nearest_rank_percentile(values, 99) == 4.0
    # weights 1,1,1,5 on 1..4: cumulative 1/8, 2/8, 3/8, 1
    weights = np.array([5.0, 1.0, 1.0, 1.0])
    assert weighted_inverse_cdf_percentile(values, weights, 25) == 2.0
    assert weighted_inverse_cdf_percentile(values, weights, 40) == 4.0


def test_conventions_side_by_side(hand_run):
    raw = slo.summarize(hand_run, conventions="all")["conventions"]
    assert set(raw) == {"harness", "vllm", "guidellm", "aiperf", "mlperf"}
    assert all(raw[tool]["source"] and raw[tool]["percentile_method"] for tool in raw)
    assert all(m["definition"] for tool in raw.values() for m in tool["metrics"].values())
    c = {tool: block["metrics"] for tool, block in raw.items()}
    # vLLM: TPOT from the last chunk, per request: r1 150/3 = 50, r2 120/1 = 120
    assert c["vllm"]["tpot"]["mean"] == pytest.approx(85)
    assert c["vllm"]["itl"]["n"] == 3  # pooled gaps 50, 100, 120
    assert c["vllm"]["e2el"]["mean"] == pytest.approx((250 + 320 + 300) / 3)
    # GuideLLM: TPOT = (last token - start) / tokens = 62.5, 160, 300 weighted 4, 2, 1
    g = c["guidellm"]["time_per_output_token_ms"]
    assert g["mean"] == pytest.approx((250 + 320 + 300) / 7)
    assert g["p50"] == pytest.approx(62.5) and g["p90"] == pytest.approx(300)
    # GuideLLM ITL = (last - first) / (tokens - 1) = 50 (weight 3), 120 (weight 1)
    assert c["guidellm"]["inter_token_latency_ms"]["mean"] == pytest.approx(67.5)
    # AIPerf ITL is per request like vLLM's TPOT
    assert c["aiperf"]["inter_token_latency"]["mean"] == pytest.approx(85)
    assert c["aiperf"]["inter_chunk_latency"]["n"] == 3
    # MLPerf: from the scheduled time (r2 scheduled 100, first token 302), nearest rank
    assert c["mlperf"]["ttft"]["mean"] == pytest.approx((100 + 202 + 300) / 3)
    assert c["mlperf"]["ttft"]["p50"] == pytest.approx(202)
    # MLPerf TPOT = (done - first token) / (n - 1): 160/3, 128
    assert c["mlperf"]["tpot"]["mean"] == pytest.approx((160 / 3 + 128) / 2)
    assert c["mlperf"]["tpot"]["p50"] == pytest.approx(128)
    assert "conventions" not in slo.summarize(hand_run)


def test_bad_conventions_value(hand_run):
    with pytest.raises(slo.SLOError, match="conventions must be 'all'"):
        slo.summarize(hand_run, conventions="vllm")
