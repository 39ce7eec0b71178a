"""Conventions side by side on the card: `bench report --conventions`, the HTML section and
the JSON card, each tool's figures with a one-line definition and a source."""

from __future__ import annotations

import json

from click.testing import CliRunner
from rundir_builder import SyntheticRun, write_run

import slo
from reports.build import build_card
from reports.cli import report
from reports.conventions_view import convention_rows
from reports.html import render_html
from slo.runrecord import Conventions

TOOLS = ("llm-bench", "vLLM", "GuideLLM", "AIPerf", "MLPerf")


def test_report_conventions_prints_every_tool_with_definitions(golden_run):
    result = CliRunner().invoke(report, [str(golden_run), "--conventions"], env={"COLUMNS": "220"})
    assert result.exit_code == 0, result.output
    assert "The same run under each tool's definitions" in result.output
    for tool in TOOLS:
        assert tool in result.output
    assert "(latency - ttft) / (output_len - 1), per request" in result.output  # vLLM's TPOT
    assert "output_tokens_per_s" in result.output
    plain = CliRunner().invoke(report, [str(golden_run)], env={"COLUMNS": "220"})
    assert "each tool's definitions" not in plain.output


def test_rows_carry_the_summary_figures(golden_run):
    raw = slo.summarize(golden_run, conventions="all")["conventions"]
    rows = convention_rows(Conventions.from_dict(raw))
    vllm_tpot = next(r for r in rows if r["tool"] == "vLLM" and r["metric"] == "tpot")
    assert vllm_tpot["p99"] == raw["vllm"]["metrics"]["tpot"]["p99"]
    assert vllm_tpot["source"].startswith("vllm/benchmarks/serve.py")
    assert {r["tool"] for r in rows} == set(TOOLS)
    assert all(r["definition"] for r in rows)


def test_html_and_json_cards_have_the_section(golden_run, tmp_path):
    card = build_card(golden_run)
    html = render_html(card)
    assert "<h2>Conventions side by side</h2>" in html
    assert "weighted inverse CDF" in html and "nearest rank" in html
    data = json.loads(card.to_json())
    assert set(data["conventions"]) == {"harness", "vllm", "guidellm", "aiperf", "mlperf"}


def test_non_streaming_card_says_why_instead_of_numbers(tmp_path):
    run = write_run(tmp_path / "r", SyntheticRun(n_requests=20))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["stream"] = False
    (run / "manifest.json").write_text(json.dumps(manifest))
    card = build_card(run)
    assert convention_rows(card.conventions) == []
    assert "not streamed" in render_html(card)
    assert "ttft" in card.undefined_metrics
