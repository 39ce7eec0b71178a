"""The `reasoning` block and the TTFT an SLO judges (`slo.reasoning`), through `summarize` and
the card, on run directories written with the production writer.

Thirty ok requests, each sent at 0 ms: the first reasoning token at 100 ms (the first token),
the last at 300 ms, the first answer token at 400 ms, the last token at 600 ms; 5 reasoning and
3 answer tokens (the server said 5 too). By hand: TTFT 100 ms to the first (reasoning) token
and 400 ms to the first answer token; TPOT (300 - 100) / 4 = 50 ms reasoning and
(600 - 400) / 2 = 100 ms answer."""

from __future__ import annotations

import pytest
from slo_runs import ms, write_run

from reports.build import build_card
from reports.console import card_renderable
from reports.html import render_html
from slo.errors import SLOError
from slo.spec import SLOSpec
from slo.summary import summarize

N = 30


def _request(i: int, *, reasoning: bool = True) -> dict:
    row = dict(request_id=f"r{i}", t_scheduled_ns=0, t_sent_ns=0, t_first_token_ns=ms(100),
               t_last_token_ns=ms(600), t_done_ns=ms(610), status="ok", input_tokens=4,
               output_tokens=8, output_tokens_source="usage", usage_completion_tokens=8)  # fmt: skip
    if reasoning:
        row.update(t_first_reasoning_token_ns=ms(100), t_last_reasoning_token_ns=ms(300),
                   t_first_answer_token_ns=ms(400), output_reasoning_tokens=5,
                   output_answer_tokens=3, usage_reasoning_tokens=5)  # fmt: skip
    else:
        row.update(t_first_answer_token_ns=ms(100), output_reasoning_tokens=0,
                   output_answer_tokens=8)  # fmt: skip
    return row


def _run(tmp_path, *, reasoning: bool = True):
    chunks = [(f"r{i}", ms(t), 1) for i in range(N) for t in (100, 200, 300, 400, 500, 600)]
    requests = [_request(i, reasoning=reasoning) for i in range(N)]
    return write_run(tmp_path / "run", requests, chunks)


def _spec(ttft: str | None) -> dict:
    spec = {"name": "ttft", "percentiles": [{"metric": "ttft_ms", "percentile": 50,
            "max_ms": 200}], "per_request": {"ttft_ms": 200}, "attainment_min": 0.5,
            "min_samples": 10}  # fmt: skip
    return spec if ttft is None else {**spec, "ttft": ttft}


def test_the_reasoning_block_by_hand(tmp_path):
    block = summarize(_run(tmp_path), _spec(None))["reasoning"]
    assert block["requests_with_reasoning"] == N
    for key, value in [("ttft_reasoning_ms", 100.0), ("ttft_answer_ms", 400.0),
                       ("tpot_reasoning_ms", 50.0), ("tpot_answer_ms", 100.0),
                       ("reasoning_tokens_per_request", 5.0), ("answer_tokens_per_request", 3.0),
                       ("server_reasoning_tokens_per_request", 5.0)]:  # fmt: skip
        assert (block[key]["p50"], block[key]["max"], block[key]["n"]) == (value, value, N), key
    assert block["slo_ttft"] == "first_token"


@pytest.mark.parametrize(
    ("ttft", "verdicts", "attainment"),
    [(None, ["pass", "pass"], 1.0), ("first_token", ["pass", "pass"], 1.0),
     ("first_answer_token", ["fail", "fail"], 0.0)],
)  # fmt: skip
def test_the_slo_judges_the_ttft_its_spec_names(tmp_path, ttft, verdicts, attainment):
    """A 200 ms TTFT limit: the first token (100 ms) meets it, the first answer token
    (400 ms) misses it on every request."""
    summary = summarize(_run(tmp_path), _spec(ttft))
    slo = summary["slo"]
    assert [o["verdict"] for o in slo["objectives"]] == verdicts
    assert summary["goodput"]["attainment"] == attainment
    said = ttft or "first_token"
    assert slo["ttft"] == said and [o["ttft"] for o in slo["objectives"]] == [said, said]
    assert summary["latency_ms"]["ttft"]["p50"] == 100.0  # the latency block: first token


def test_the_slices_judge_the_same_ttft_as_the_slo(tmp_path):
    """Every request is in one input-length slice: its attainment is the SLO's own (0 with the
    first answer token at 400 ms against a 200 ms limit, 1 with the first token at 100 ms), and
    its TTFT percentiles are the ones judged."""
    for ttft, attainment, p50 in [("first_token", 1.0, 100.0), ("first_answer_token", 0.0, 400.0)]:
        summary = summarize(_run(tmp_path / ttft), _spec(ttft))
        (row,) = [r for r in summary["slices"]["input_tokens"] if r["n"]]
        assert summary["goodput"]["attainment"] == attainment
        assert (row["attainment"], row["latency_ms"]["ttft"]["p50"]) == (attainment, p50), row


def test_a_run_without_reasoning_has_no_block_and_says_nothing_new(tmp_path):
    summary = summarize(_run(tmp_path, reasoning=False), _spec(None))
    assert summary["reasoning"] is None and "ttft" not in summary["slo"]
    assert all("ttft" not in o for o in summary["slo"]["objectives"])
    # first_answer_token on a run without reasoning judges the same first token
    summary = summarize(tmp_path / "run", _spec("first_answer_token"))
    assert [o["verdict"] for o in summary["slo"]["objectives"]] == ["pass", "pass"]
    assert summary["slo"]["ttft"] == "first_answer_token"
    assert "reasoning" not in build_card(tmp_path / "run").to_dict()


def test_the_card_shows_the_reasoning_section(tmp_path):
    run = _run(tmp_path)
    card = build_card(run, summary=summarize(run, _spec("first_answer_token")))
    assert card.reasoning.requests_with_reasoning == N
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(card_renderable(card))
    text = console.export_text()
    assert "Reasoning and answer" in text and "TTFT to first answer token (ms)" in text
    assert "(TTFT to first answer token)" in text  # the verdict says which TTFT it judged
    html = render_html(card)
    assert "Reasoning and answer" in html and "first_answer_token" in html


def test_a_misspelt_ttft_is_one_sentence():
    with pytest.raises(SLOError, match="ttft: got 'answer'; expected one of first_token"):
        SLOSpec.from_dict({"name": "x", "ttft": "answer"})
