"""The prompt-token cross-check, the server-metrics summary and the correctness summary,
against hand-worked cases."""

from __future__ import annotations

import json

import numpy as np
import pytest

from slo.correctness import compare_tokens, correctness_summary, in_flight_at_send
from slo.prompt_tokens import disagreeing, prompt_token_check
from slo.runrecord import (
    SERVER_METRICS_SCHEMA,
    OutputFlag,
    RequestRecord,
    RequestStatus,
)
from slo.runrecord.schema import columns_table, requests_table
from slo.server_metrics import NOT_AVAILABLE, counter_increase, server_metrics_summary


@pytest.mark.parametrize(
    ("inp", "usage", "overhead", "bad"),
    [
        (100, 105, 0, False),  # 5% of 100 = 5: at the tolerance
        (100, 106, 0, True),  # just above
        (40, 44, 0, False),  # the absolute tolerance of 4 tokens
        (40, 45, 0, True),
        (40, 60, 20, False),  # a chat template's constant 20 tokens
        (40, 65, 20, True),
        (0, 4, 0, False),  # an empty prompt: only the absolute tolerance
    ],
)
def test_disagreeing_boundaries(inp, usage, overhead, bad):
    assert disagreeing(np.array([inp]), np.array([usage]), overhead).tolist() == [bad]


def test_wrong_tokenizer_is_reported_with_its_ratio():
    inp = np.array([100.0, 200.0, 50.0])
    usage = np.array([296.0, 592.0, 148.0])  # 2.96x, as the issue found
    check = prompt_token_check(inp, usage)
    assert check["verdict"] == "disagree"
    assert check["n_disagreeing"] == 3
    assert check["ratio"] == pytest.approx(1036 / 350)
    assert "2.96x" in check["sentence"] and "--tokenizer" in check["sentence"]


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ([25.0, 25.0, 25.0], "0.50x the prompt tokens"),  # (25 - 20) / 10
        ([20.0, 20.0, 20.0], "fewer prompt tokens than the chat template alone adds (20 per"),
        ([5.0, 5.0, 5.0], "fewer prompt tokens than the chat template alone adds (20 per"),
    ],
)
def test_a_server_counting_below_the_template_overhead_gets_no_negative_ratio(usage, expected):
    """A server that applies no chat template (a mock counting words) counts fewer tokens than
    the template alone adds: the sentence says so instead of a ratio of 0 or below."""
    check = prompt_token_check(np.full(3, 10.0), np.array(usage), overhead_tokens=20)
    assert check["verdict"] == "disagree"
    assert expected in check["sentence"] and "3 of 3 requests disagree" in check["sentence"]
    assert "-" not in check["sentence"].split(":")[0]


def test_constant_chat_overhead_agrees_and_missing_usage_is_not_checked():
    inp = np.array([100.0, 7.0, np.nan])
    usage = np.array([131.0, 38.0, 50.0])
    check = prompt_token_check(inp, usage, overhead_tokens=31)
    assert check["verdict"] == "agree" and check["n_compared"] == 2 and check["sentence"] is None
    assert check["ratio"] == pytest.approx(1.0)
    none = prompt_token_check(np.array([10.0]), np.array([np.nan]))
    assert none["verdict"] == "not_checked" and none["ratio"] is None


def test_one_disagreeing_request_in_twenty_is_tolerated_two_are_not():
    inp = np.full(20, 100.0)
    usage = inp.copy()
    usage[0] = 300
    assert prompt_token_check(inp, usage)["verdict"] == "agree"  # 1/20 = 5%: not above
    usage[1] = 300
    assert prompt_token_check(inp, usage)["verdict"] == "disagree"


def _metrics_table(rows):
    return columns_table(
        [(t, n, json.dumps(lbl, sort_keys=True), v) for t, n, lbl, v in rows],
        SERVER_METRICS_SCHEMA,
    )


def test_server_metrics_summary_hand_worked():
    s = 1_000_000_000
    rows = [
        # two engines: their gauges add up at each scrape
        (0, "vllm:num_requests_running", {"engine": "0"}, 1.0),
        (0, "vllm:num_requests_running", {"engine": "1"}, 2.0),
        (s, "vllm:num_requests_running", {"engine": "0"}, 4.0),
        (s, "vllm:num_requests_running", {"engine": "1"}, 1.0),
        (0, "vllm:num_requests_waiting", {}, 0.0),
        (s, "vllm:num_requests_waiting", {}, 6.0),
        (0, "vllm:gpu_cache_usage_perc", {}, 0.25),  # the older vLLM spelling
        (s, "vllm:gpu_cache_usage_perc", {}, 0.75),
        (0, "vllm:prefix_cache_queries_total", {}, 100.0),
        (s, "vllm:prefix_cache_queries_total", {}, 300.0),
        (0, "vllm:prefix_cache_hits_total", {}, 10.0),
        (s, "vllm:prefix_cache_hits_total", {}, 60.0),
        (0, "vllm:num_preemptions_total", {}, 3.0),
        (s, "vllm:num_preemptions_total", {}, 5.0),
    ]
    out = server_metrics_summary(_metrics_table(rows))
    assert out["available"] is True
    assert out["gauges"]["running"] == {"mean": 4.0, "max": 5.0, "last": 5.0}
    assert out["gauges"]["waiting"]["max"] == 6.0
    assert out["gauges"]["kv_cache_usage"]["mean"] == pytest.approx(0.5)
    assert out["counters"]["preemptions"] == 2.0
    assert out["prefix_cache_hit_rate"] == pytest.approx(50 / 200)
    assert out["spec_decode_acceptance"] is None  # not exported
    assert out["series"]["running"] == [[0.0, 3.0], [1.0, 5.0]]


def test_spec_decode_acceptance_and_counter_resets():
    assert counter_increase(np.array([5.0, 7.0, 2.0, 4.0])) == 2 + 2 + 2  # reset to 2 counts 2
    assert counter_increase(np.array([5.0])) == 0.0
    rows = [
        (0, "vllm:spec_decode_num_draft_tokens_total", {}, 0.0),
        (1, "vllm:spec_decode_num_draft_tokens_total", {}, 40.0),
        (0, "vllm:spec_decode_num_accepted_tokens_total", {}, 0.0),
        (1, "vllm:spec_decode_num_accepted_tokens_total", {}, 30.0),
    ]
    assert server_metrics_summary(_metrics_table(rows))["spec_decode_acceptance"] == 0.75


def test_a_target_without_metrics_says_not_available():
    out = server_metrics_summary(SERVER_METRICS_SCHEMA.empty_table())
    assert out == {"available": False, "reason": NOT_AVAILABLE, "samples": 0}
    assert "not available" in out["reason"]


@pytest.mark.parametrize(
    ("ref", "out", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], (True, None, 1.0)),
        ([1, 2, 3], [1, 9, 3], (False, 1, 2 / 3)),
        ([1, 2, 3], [1, 2], (False, 2, 2 / 3)),  # cut short: diverges where it stops
        ([1, 2], [1, 2, 3, 4], (False, 2, 2 / 4)),
        ([5], [6], (False, 0, 0.0)),
        ([], [], (True, None, 1.0)),
        ([], [1], (False, 0, 0.0)),
    ],
)
def test_compare_tokens(ref, out, expected):
    assert compare_tokens(ref, out) == expected


def test_in_flight_at_send_hand_worked():
    # a: 0-10, b: 2-4, c: 5-12, d: never sent
    sent = np.array([0.0, 2.0, 5.0, np.nan])
    done = np.array([10.0, 4.0, 12.0, np.nan])
    got = in_flight_at_send(sent, done)
    assert got[:3].tolist() == [1.0, 2.0, 2.0] and np.isnan(got[3])


def test_correctness_summary_rates_by_load():
    def rec(rid, sent, done, exact, flags=None):
        return RequestRecord(
            request_id=rid,
            t_sent_ns=sent,
            t_done_ns=done,
            status=RequestStatus.OK,
            output_exact_match=exact,
            output_agreement=1.0 if exact else 0.5,
            output_flags=flags,
        )

    table = requests_table(
        [
            rec("a", 0, 100, True),
            rec("b", 10, 20, False, OutputFlag.DIVERGED.value),  # sent with a in flight
            rec("c", 200, 300, True),
            rec("d", 210, 220, None, OutputFlag.USAGE_MISMATCH.value),  # not compared
        ]
    )
    out = correctness_summary(table, diverge_before=32)
    assert out["n_compared"] == 3 and out["n_exact"] == 2 and out["n_wrong"] == 1
    assert out["exact_rate"] == pytest.approx(2 / 3)
    assert out["agreement_mean"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert out["flags"][OutputFlag.USAGE_MISMATCH] == 1
    assert out["by_load"] == [
        {"load": "1", "n": 2, "exact_rate": 1.0, "wrong_rate": 0.0},
        {"load": "2", "n": 1, "exact_rate": 0.0, "wrong_rate": 1.0},
    ]
    assert correctness_summary(requests_table([rec("x", 0, 1, None)])) is None


def test_divergence_by_server_batch_reads_the_running_gauge_before_each_send():
    from slo.correctness import server_running_at

    metrics = _metrics_table(
        [
            (100, "vllm:num_requests_running", {}, 0.0),
            (200, "vllm:num_requests_running", {}, 3.0),
            (300, "vllm:num_requests_running", {}, 9.0),
        ]
    )
    got = server_running_at(np.array([50.0, 100.0, 250.0, 1000.0, np.nan]), metrics)
    assert np.isnan(got[0]) and got[1:4].tolist() == [0.0, 3.0, 9.0] and np.isnan(got[4])
    assert np.isnan(server_running_at(np.array([1.0]), None)).all()

    def rec(rid, sent, exact, flags=None):
        return RequestRecord(
            request_id=rid, t_sent_ns=sent, t_done_ns=sent + 1, status=RequestStatus.OK,
            output_exact_match=exact, output_agreement=1.0, output_flags=flags,
        )  # fmt: skip

    table = requests_table(
        [
            rec("a", 150, True),
            rec("b", 250, True),
            rec("c", 260, False, "diverged"),
            rec("d", 400, False, "diverged"),
        ]  # fmt: skip
    )
    out = correctness_summary(table, server_metrics=metrics)
    assert out["by_server_batch"] == [
        {"batch": "1", "n": 1, "exact_rate": 1.0, "wrong_rate": 0.0},  # 0 running: itself
        {"batch": "3-4", "n": 2, "exact_rate": 0.5, "wrong_rate": 0.5},
        {"batch": "9-16", "n": 1, "exact_rate": 0.0, "wrong_rate": 1.0},
    ]
