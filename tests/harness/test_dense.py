"""`--endpoint embeddings` and `--endpoint rerank`: the bodies sent, the batches, the checks of
the answers, and whole runs against the mock (latency truth, the summary's `dense` block, the
card) through `bench run`'s library path."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from harness.errors import HarnessError
from harness.http.client import ClientOptions, body_fields
from harness.http.dense import DENSE_INPUTS, DENSE_QUERY, check_answer
from harness.run.config import RunConfig
from harness.run.dense_plan import batch_sizes, dense_rows, parse_batch_size
from harness.run.orchestrator import run_benchmark
from reports.build import build_card
from reports.console import render_summary
from reports.html import render_html
from slo.runrecord import Endpoint, ErrorClass

E, R = Endpoint.EMBEDDINGS, Endpoint.RERANK


def _rows(n: int) -> list[dict]:
    return [
        {"request_id": f"r{k}", "prompt": f"text {k}", "input_tokens": 10 + k} for k in range(n)
    ]


# --- the bodies and the batches ------------------------------------------------------------


def test_bodies_are_the_openai_and_rerank_shapes_never_streamed():
    options = ClientOptions(base_url="http://x/v1", model="m", endpoint=E, stream=True)
    assert options.stream is False and options.url == "http://x/v1/embeddings"
    row = {"prompt": "p", DENSE_INPUTS: ["a", "b"], "max_output_tokens": 8, "tenant": "t"}
    assert body_fields(options, row) == {
        "model": "m", "input": ["a", "b"], "encoding_format": "float", "user": "t",
    }  # fmt: skip
    rerank = ClientOptions(base_url="http://x/v1", model="m", endpoint=R)
    row = {"prompt": "p", DENSE_INPUTS: ["a", "b"], DENSE_QUERY: "q", "max_output_tokens": 8}
    assert body_fields(rerank, row) == {"model": "m", "query": "q", "documents": ["a", "b"]}
    # a row without a batch sends its own prompt as a batch of one
    assert body_fields(options, {"prompt": "p", "max_output_tokens": 8})["input"] == ["p"]


def test_a_request_takes_the_next_prompts_wrapping_and_sums_their_tokens():
    rows = dense_rows(_rows(3), E, [1, 2, 3])
    assert [r[DENSE_INPUTS] for r in rows] == [
        ["text 0"], ["text 1", "text 2"], ["text 2", "text 0", "text 1"],
    ]  # fmt: skip
    assert [r["input_tokens"] for r in rows] == [10, 11 + 12, 12 + 10 + 11]
    assert [r["request_id"] for r in rows] == ["r0", "r1", "r2"]
    # rerank: the row's prompt is the query, the documents the next prompts
    rows = dense_rows(_rows(3), R, [2, 1, 1])
    assert rows[0][DENSE_QUERY] == "text 0" and rows[0][DENSE_INPUTS] == ["text 1", "text 2"]
    assert rows[2][DENSE_INPUTS] == ["text 0"]
    assert [r["input_tokens"] for r in rows] == [10 + 11 + 12, 11 + 12, 12 + 10]


def test_batch_sizes_fixed_or_drawn_and_bad_values_are_one_sentence():
    assert batch_sizes(None, 3, seed=0) == [1, 1, 1]
    assert batch_sizes(4, 3, seed=0) == [4, 4, 4]
    drawn = batch_sizes(parse_batch_size("{dist: uniform, low: 2, high: 5}"), 200, seed=1)
    assert min(drawn) == 2 and max(drawn) == 5 and len(set(drawn)) == 4
    assert drawn == batch_sizes({"dist": "uniform", "low": 2, "high": 5}, 200, seed=1)
    assert parse_batch_size("8") == 8
    for bad in ("0", "-3", "many", "1.5", "{dist: nope}"):
        with pytest.raises(HarnessError, match=r"^--batch-size must be .*\.$"):
            RunConfig(url="http://x/v1", batch_size=bad)


def test_sessions_do_not_apply():
    rows = _rows(2)
    rows[0]["session_id"] = "s0"
    with pytest.raises(HarnessError, match="multi-turn"):
        dense_rows(rows, E, [1, 1])


# --- the checks of an answer ---------------------------------------------------------------


def _embeddings(*vectors) -> bytes:
    data = [{"index": i, "embedding": v} for i, v in enumerate(vectors)]
    return orjson.dumps({"data": data, "usage": {"prompt_tokens": 7}})


def _rerank(*pairs) -> bytes:
    return orjson.dumps({"results": [{"index": i, "relevance_score": s} for i, s in pairs]})


@pytest.mark.parametrize(
    ("body", "endpoint", "expected", "problem"),
    [
        (_embeddings([0.6, 0.8], [1.0, 0.0]), E, 2, None),
        (_embeddings([0.6, 0.8]), E, 2, "holds 1 embeddings for 2 sent"),
        (_embeddings([0.6, 0.8], [1.0]), E, 2, "differ in length (1 to 2)"),
        (b'{"data": [{"index": 0, "embedding": [NaN]}]}', E, 1, "not JSON"),
        (orjson.dumps({"data": [{"embedding": [None]}]}), E, 1, "not a finite number"),
        (orjson.dumps({"data": [{"index": 3, "embedding": [1.0]}]}), E, 1, "outside 0..0"),
        (orjson.dumps({"data": []}), E, None, "holds no embeddings"),
        (orjson.dumps({"object": "list"}), E, 1, "lacks a data list"),
        (_rerank((1, 0.9), (0, 0.1)), R, 2, None),
        (_rerank((1, 0.9)), R, 2, "holds 1 scores for 2 sent"),
        (_rerank((2, 0.9), (0, 0.1)), R, 2, "document index 2 is outside 0..1"),
        (_rerank((0, 0.9), (0, 0.1)), R, 2, "repeats a document index"),
        (_rerank((0, "high")), R, 1, "relevance_score is not a finite number"),
        (b"[]", R, 1, "not a JSON object"),
    ],
)
def test_check_answer(body, endpoint, expected, problem):
    answer = check_answer(body, endpoint, expected)
    if problem is None:
        assert answer.error_message is None and answer.error_class is None
    else:
        assert problem in answer.error_message
        assert answer.error_class is ErrorClass.MALFORMED_JSON


# --- whole runs against the mock -------------------------------------------------------------


def _run(url: str, tmp_path, endpoint: str, **overrides):
    config = dict(url=url, workload="random", endpoint=endpoint, input_len=8, num_requests=30,
                  tokenizer="tiny-random", out=tmp_path / "run", request_rate=25.0, seed=5)  # fmt: skip
    config.update(overrides)
    return run_benchmark(RunConfig(**config))


def _latency_ms(run_dir) -> np.ndarray:
    req = pq.read_table(run_dir / "requests.parquet").to_pydict()
    return (np.array(req["t_done_ns"]) - np.array(req["t_sent_ns"])) / 1e6


@pytest.mark.serial
def test_embeddings_latency_matches_the_mock_within_2_ms(mock_server, tmp_path):
    """The mock answers 30 ms + 2 ms per input after arrival; batches of 3: 36 ms each, the
    truth. The same run against a mock that answers at once measures the round trip both
    processes add (about 1 ms here, 2 with the mock's timer rounding up to the next ms); the
    median latency less that is within +/-2 ms of the truth, and never below it. A wrong clock,
    unit or per-input cost misses by far more. The summary and card carry it with the batch
    sizes and no token latencies."""
    with mock_server("--ttft-ms", "0", "--itl-ms", "0") as url:
        baseline = _run(url, tmp_path, "embeddings", batch_size=3, out=tmp_path / "zero")
    with mock_server("--ttft-ms", "30", "--itl-ms", "2") as url:
        outcome = _run(url, tmp_path, "embeddings", batch_size=3)
    req = pq.read_table(outcome.run_dir / "requests.parquet").to_pydict()
    assert req["status"] == ["ok"] * 30 and req["num_texts"] == [3] * 30
    latency_ms = _latency_ms(outcome.run_dir)
    round_trip_ms = np.median(_latency_ms(baseline.run_dir))
    assert np.median(latency_ms) >= 36.0
    assert abs(np.median(latency_ms) - round_trip_ms - 36.0) <= 2.0, (latency_ms, round_trip_ms)
    assert req["t_first_token_ns"] == [None] * 30 and req["output_tokens"] == [0] * 30
    summary = json.loads((outcome.run_dir / "summary.json").read_text())
    dense = summary["dense"]
    assert dense["api"] == "embeddings" and dense["texts_per_request"]["p50"] == 3
    assert dense["latency_ms"]["p50"] == pytest.approx(np.median(latency_ms), abs=1e-6)
    assert dense["input_tokens_source"] == "usage"
    assert dense["texts_per_s"] == pytest.approx(3 * dense["request_per_s"])
    assert summary["latency_ms"]["ttft"]["n"] == 0 and "ttft" in summary["undefined_metrics"]
    assert summary["streamed"] is False
    card = build_card(outcome.run_dir)
    assert [row.metric for row in card.latency] == ["e2e"]
    assert "output_tokens_per_s" not in [t.name for t in card.throughput]
    assert card.failures.ok == 30 and card.failures.wrong_output == 0
    console = Console(record=True, width=160)
    render_summary(card, console)
    text = console.export_text()
    assert "TTFT, TPOT, ITL: undefined: embeddings and rerank" in text
    assert "texts per request (batch size)" in text and "TPOT     0" not in text


def test_rerank_through_the_mock_and_a_malformed_answer_is_an_error(mock_server, tmp_path):
    with mock_server("--ttft-ms", "1", "--itl-ms", "0") as url:
        ok = _run(url, tmp_path / "ok", "rerank", batch_size="{dist: uniform, low: 1, high: 4}",
                  out=tmp_path / "ok")  # fmt: skip
    req = pq.read_table(ok.run_dir / "requests.parquet").to_pydict()
    assert req["status"] == ["ok"] * 30 and set(req["num_texts"]) == {1, 2, 3, 4}
    # the HTML card draws the request latency and leaves out the token charts it cannot draw
    html = render_html(build_card(ok.run_dir))
    assert 'data-chart="End-to-end latency CDF"' in html and "<svg" in html
    assert "no data to draw" not in html and "texts per request (batch size)" in html
    with mock_server("--ttft-ms", "1", "--itl-ms", "0", "--malformed-json-rate", "1") as url:
        bad = _run(url, tmp_path, "rerank", batch_size=2, num_requests=4, out=tmp_path / "bad")
    req = pq.read_table(bad.run_dir / "requests.parquet").to_pydict()
    assert req["status"] == ["error"] * 4 and req["error_class"] == ["malformed_json"] * 4
    assert req["error_message"][0] == "the response holds 1 scores for 2 sent"
