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
    # Output tokens/s: 4 + 2 + 1 ok tokens over first send (0) to last done (505 ms)
    for tool in raw.values():
        rate = tool["throughput"]["output_tokens_per_s"]
        assert rate["value"] == pytest.approx(7 / 0.505) and rate["definition"]
    assert "conventions" not in slo.summarize(hand_run)


def test_bad_conventions_value(hand_run):
    with pytest.raises(slo.SLOError, match="conventions must be 'all'"):
        slo.summarize(hand_run, conventions="vllm")


def chat_stream(tmp_path, endpoint):
    from slo_runs import ms, write_run

    # role chunk at 40 ms, tokens at 100, 150, 210, usage chunk at 220, done at 225
    rows = [dict(request_id="c1", t_scheduled_ns=0, t_sent_ns=0, t_first_token_ns=ms(100),
                 t_last_token_ns=ms(210), t_done_ns=ms(225), status="ok", output_tokens=3)]  # fmt: skip
    chunks = [("c1", ms(40), 0), ("c1", ms(100), 1), ("c1", ms(150), 1), ("c1", ms(210), 1),
              ("c1", ms(220), 0)]  # fmt: skip
    run = write_run(tmp_path / endpoint, rows, chunks, {"target": {"endpoint": endpoint}})
    raw = slo.summarize(run, conventions="all")["conventions"]
    return {tool: block["metrics"] for tool, block in raw.items()}


def test_vllm_chat_times_the_role_chunk_and_the_usage_chunk(tmp_path):
    c = chat_stream(tmp_path, "chat")
    assert c["vllm"]["ttft"]["mean"] == pytest.approx(40)
    assert c["vllm"]["itl"]["n"] == 3 and c["vllm"]["itl"]["mean"] == pytest.approx(170 / 3)
    assert c["vllm"]["e2el"]["mean"] == pytest.approx(220)
    assert c["vllm"]["tpot"]["mean"] == pytest.approx((220 - 40) / 2)
    # the harness's own definitions ignore role and usage chunks
    assert c["harness"]["ttft"]["mean"] == pytest.approx(100)
    assert c["harness"]["tpot"]["mean"] == pytest.approx(55)
    # AIPerf: (last response - ttft) / (osl - 1), its latency ending at the usage chunk
    assert c["aiperf"]["inter_token_latency"]["mean"] == pytest.approx(60)
    assert c["aiperf"]["inter_chunk_latency"]["n"] == 2
    assert c["mlperf"]["tpot"]["mean"] == pytest.approx(62.5)


def test_vllm_completions_times_text_chunks_only(tmp_path):
    c = chat_stream(tmp_path, "completions")
    assert c["vllm"]["ttft"]["mean"] == pytest.approx(100)
    assert c["vllm"]["itl"]["n"] == 2
    assert c["vllm"]["e2el"]["mean"] == pytest.approx(210)
    assert c["vllm"]["tpot"]["mean"] == pytest.approx(55)
