"""The regression gate on synthetic run pairs, its verdict rules, outputs and CLI."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
from click.testing import CliRunner
from rundir_builder import SyntheticRun, write_run

import slo
from reports.cli import compare
from reports.errors import ReportError
from reports.gate import judge, run_gate
from reports.gate_config import GateConfig, load_gate_config
from reports.gate_report import to_junit_xml, to_markdown
from slo.comparison import RatioEstimate

FAST = GateConfig(n_resamples=500)
P50_LATENCIES = ("ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms", "e2e_p50_ms")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs of one workload (same arrivals and lengths); service noise differs by seed."""
    root = tmp_path_factory.mktemp("gate")
    specs = {
        "base": SyntheticRun(n_requests=1000, seed=100),
        "same": SyntheticRun(n_requests=1000, seed=101, write_summary=False),
        "slow": SyntheticRun(n_requests=1000, seed=102, latency_scale=1.2, write_summary=False),
        "fast": SyntheticRun(n_requests=1000, seed=103, latency_scale=0.75, write_summary=False),
        "tiny": SyntheticRun(n_requests=12, seed=104, write_summary=False),
        "other": SyntheticRun(n_requests=50, workload_sha256="b" * 64, write_summary=False),
    }
    return {name: write_run(root / name, spec) for name, spec in specs.items()}


def _verdicts(result) -> dict[str, str]:
    return {r.metric: r.verdict for r in result.results}


def test_twenty_percent_latency_regression_is_caught(runs):
    result = run_gate(runs["base"], runs["slow"], config=FAST)
    verdicts = _verdicts(result)
    assert result.verdict == "regressed" and result.exit_code == 1
    assert all(verdicts[m] == "regressed" for m in P50_LATENCIES)
    assert verdicts["output_tokens_per_s"] == "pass"
    ttft = next(r for r in result.results if r.metric == "ttft_p50_ms")
    assert 1.1 < ttft.estimate.ci_low and ttft.mann_whitney_p < 1e-6


def test_unchanged_candidate_passes(runs):
    result = run_gate(runs["base"], runs["same"], config=FAST)
    assert result.verdict == "pass" and result.exit_code == 0
    assert set(_verdicts(result).values()) == {"pass"}


def test_too_few_samples_is_inconclusive(runs):
    result = run_gate(runs["base"], runs["tiny"], config=FAST)
    assert result.verdict == "inconclusive" and result.exit_code == 3
    ttft_p99 = next(r for r in result.results if r.metric == "ttft_p99_ms")
    assert ttft_p99.verdict == "inconclusive" and "too few samples (12 < 20)" in ttft_p99.reason


def test_improvement_is_reported_as_improved(runs):
    result = run_gate(runs["base"], runs["fast"], config=FAST)
    verdicts = _verdicts(result)
    assert all(verdicts[m] == "improved" for m in P50_LATENCIES)
    assert result.verdict == "pass" and result.exit_code == 0


def test_point_estimates_are_the_summary_figures(runs):
    summary = slo.summarize(runs["base"])
    result = run_gate(runs["base"], runs["same"], config=replace(FAST, n_resamples=100))
    by_metric = {r.metric: r.estimate.baseline for r in result.results}
    assert by_metric["ttft_p50_ms"] == pytest.approx(summary["latency_ms"]["ttft"]["p50"])
    assert by_metric["itl_p99_ms"] == pytest.approx(summary["latency_ms"]["itl"]["p99"])
    assert by_metric["e2e_p99_ms"] == pytest.approx(summary["latency_ms"]["e2e"]["p99"])
    assert by_metric["output_tokens_per_s"] == pytest.approx(
        summary["throughput"]["output_tokens_per_s"]
    )
    assert by_metric["request_per_s"] == pytest.approx(summary["throughput"]["request_per_s"])
    assert by_metric["goodput_request_per_s"] == pytest.approx(summary["goodput"]["request_per_s"])


def test_repetitions_resample_whole_runs(tmp_path):
    for i in range(3):
        write_run(
            tmp_path / "base" / f"rep{i}", SyntheticRun(n_requests=150, seed=i, write_summary=False)
        )
        write_run(
            tmp_path / "cand" / f"rep{i}",
            SyntheticRun(n_requests=150, seed=10 + i, latency_scale=1.3, write_summary=False),
        )
    config = GateConfig(n_resamples=200, only=("ttft_p50_ms", "output_tokens_per_s"))
    result = run_gate(tmp_path / "base", tmp_path / "cand", config=config)
    ttft = next(r for r in result.results if r.metric == "ttft_p50_ms")
    assert ttft.estimate.resampled_baseline == ttft.estimate.resampled_candidate == "runs"
    assert ttft.estimate.runs_baseline == 3 and ttft.verdict == "regressed"
    rate = next(r for r in result.results if r.metric == "output_tokens_per_s")
    assert rate.mann_whitney_p is not None  # three per-run rates on each side


def _estimate(ratio, low, high, base=100.0, n=1000):
    return RatioEstimate(
        baseline=base, candidate=base * ratio, ratio=ratio, ci_low=low, ci_high=high,
        confidence=0.95, n_resamples=100, n_baseline=n, n_candidate=n, units_baseline=n,
        units_candidate=n, runs_baseline=1, runs_candidate=1, resampled_baseline="requests",
        resampled_candidate="requests",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("estimate", "higher_is_better", "expected"),
    [
        (_estimate(1.20, 1.15, 1.25), False, "regressed"),  # latency up 20%, significant
        (_estimate(1.20, 0.95, 1.40), False, "inconclusive"),  # up 20%, interval spans 1
        (_estimate(1.03, 1.01, 1.05), False, "pass"),  # within 5%
        (_estimate(0.80, 0.75, 0.85), False, "improved"),
        (_estimate(0.80, 0.60, 1.10), False, "pass"),  # improvement not shown: no block
        (_estimate(0.80, 0.75, 0.85), True, "regressed"),  # throughput down 20%
        (_estimate(1.20, 1.15, 1.25, base=2.0), False, "pass"),  # +0.4 ms: under the floor
        (_estimate(1.20, 1.15, 1.25, n=10), False, "inconclusive"),  # too few samples
        (_estimate(math.nan, math.nan, math.nan), False, "inconclusive"),
    ],
)
def test_verdict_rules(estimate, higher_is_better, expected):
    verdict, reason = judge(
        estimate, higher_is_better=higher_is_better, relative=0.05, floor=1.0, min_n=20
    )
    assert verdict == expected, reason


@pytest.mark.parametrize(
    ("baseline", "candidate", "expected"),
    [
        (0.0, 0.0, "pass"),  # zero against zero is no change
        (0.0, 0.5, "pass"),  # no ratio, but within the 1 ms noise floor
        (0.0, 1.0, "pass"),  # at the floor
        (0.0, 1.5, "inconclusive"),  # beyond it: no ratio to judge by
        (100.0, 100.0, "pass"),  # equal, whatever the interval says
    ],
)
def test_zero_baselines_and_equal_figures(baseline, candidate, expected):
    ratio = candidate / baseline if baseline else math.nan
    estimate = replace(_estimate(1.0, math.nan, math.nan), baseline=baseline,
                       candidate=candidate, ratio=ratio)  # fmt: skip
    verdict, reason = judge(estimate, higher_is_better=False, relative=0.05, floor=1.0, min_n=20)
    assert verdict == expected, reason


def test_a_run_compared_with_itself_passes_even_with_a_zero_metric(tmp_path):
    """A mock that sends tokens in bursts has ITL p50 = 0: equal is equal, exit 0."""
    run = write_run(tmp_path / "bursty", SyntheticRun(n_requests=200, tpot_ms_median=0.0))
    assert slo.summarize(run)["latency_ms"]["itl"]["p50"] == 0.0
    result = CliRunner().invoke(compare, [str(run), str(run), "--gate"])
    assert result.exit_code == 0, result.output
    assert set(_verdicts(run_gate(run, run, config=FAST)).values()) == {"pass"}


def test_tail_quantile_needs_enough_values():
    # 60 requests pass the 20-request floor, but a p99 needs 100 values.
    estimate = _estimate(1.20, 1.15, 1.25, n=60)
    verdict, reason = judge(
        estimate, higher_is_better=False, relative=0.05, floor=1.0, min_n=20, min_values=100
    )
    assert (verdict, reason) == ("inconclusive", "too few samples (60 < 100)")


def test_thresholds_file_overrides_defaults(tmp_path, runs):
    path = tmp_path / "t.yaml"
    path.write_text(
        "thresholds:\n  p50: {relative: 0.5}\n  p99: {relative: 0.5}\n"
        "metrics:\n  ttft_p50_ms: {relative: 0.1, floor: 2}\nn_resamples: 300\nseed: 3\n"
    )
    config = load_gate_config(path)
    assert config.seed == 3 and config.n_resamples == 300
    result = run_gate(runs["base"], runs["slow"], config=config)
    verdicts = _verdicts(result)
    assert verdicts["ttft_p50_ms"] == "regressed"  # its own 10% threshold
    assert verdicts["tpot_p50_ms"] == "pass"  # 20% is within the class's 50%


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colour: red\n", r"t\.yaml:1: unknown key 'colour'; known keys: thresholds, "),
        (
            "metrics:\n  ttft_p42_ms: {relative: 0.1}\n",
            r"t\.yaml:2: metrics: unknown key 'ttft_p42_ms' \(did you mean 'ttft_p\d\d_ms'\?\); "
            r"known keys: output_tokens_per_s, ",
        ),
        (
            "thresholds:\n  p50: {relative: -1}\n",
            r"t\.yaml:2: thresholds\.p50\.relative: got -1; expected a fraction in \[0, 10\)",
        ),
        ("thresholds: [\n", r"t\.yaml:2: not valid YAML \(.*\); fix its syntax"),
        ("seed: 1\nmin_samples: 0\n", r"t\.yaml:2: min_samples: got 0; expected an integer >= 1"),
        ("only: [ttft_p50_ms, ttfb]\n", r"t\.yaml:1: only\[1\]: got 'ttfb'; expected one of "),
        ("floors_ms: {ttft: -1}\n", r"floors_ms\.ttft: got -1; expected a noise floor in ms >= 0"),
    ],
)
def test_bad_thresholds_file_is_one_sentence(tmp_path, text, message):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ReportError, match=message):
        load_gate_config(path)


def test_markdown_and_junit_outputs(runs):
    result = run_gate(runs["base"], runs["slow"], config=FAST)
    markdown = to_markdown(result)
    assert markdown.startswith("## Regression gate: ❌ regressed")
    assert markdown.count("\n| ") == 1 + len(result.results)
    suite = ET.fromstring(to_junit_xml(result)).find("testsuite")
    regressed = sum(r.verdict == "regressed" for r in result.results)
    assert int(suite.get("tests")) == len(result.results)
    assert int(suite.get("failures")) == regressed == len(suite.findall("testcase/failure"))


def test_different_workloads_are_refused(runs):
    with pytest.raises(ReportError, match="different workloads"):
        run_gate(runs["base"], runs["other"], config=FAST)


@pytest.mark.parametrize(
    ("candidate", "exit_code"), [("slow", 1), ("same", 0), ("tiny", 3), ("other", 2)]
)
def test_cli_exit_codes(runs, tmp_path, candidate, exit_code):
    md, junit = tmp_path / "gate.md", tmp_path / "gate.xml"
    thresholds = tmp_path / "t.yaml"
    thresholds.write_text("n_resamples: 300\n")
    args = [str(runs["base"]), str(runs[candidate]), "--gate", "--thresholds", str(thresholds)]
    result = CliRunner().invoke(compare, [*args, "--markdown", str(md), "--junit", str(junit)])
    assert result.exit_code == exit_code, result.output
    if exit_code == 2:
        assert "Error: Refusing to gate runs of different workloads" in result.output
        assert "Traceback" not in result.output
    else:
        assert md.read_text().startswith("## Regression gate") and junit.read_text().startswith(
            "<?xml"
        )


def test_cli_help_documents_exit_codes():
    text = CliRunner().invoke(compare, ["--help"]).output
    for line in ("0  pass", "1  regression", "3  inconclusive"):
        assert line in text


def test_gate_console_view_matches_golden(runs):
    """Regenerate with UPDATE_GOLDEN=1 (review the diff)."""
    import io
    import os
    from pathlib import Path

    from rich.console import Console

    from reports.console import gate_renderable

    result = run_gate(runs["base"], runs["slow"], config=GateConfig(n_resamples=200))
    out = io.StringIO()
    Console(file=out, width=100, color_system=None, force_terminal=False).print(
        gate_renderable(result)
    )
    text = "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"
    text = text.replace(str(runs["base"].parent), "<runs>")
    golden = Path(__file__).parent / "golden" / "console_gate.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_incomplete_and_client_bound_runs_are_noted(tmp_path):
    import json

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from reports.build import build_card

    base = write_run(tmp_path / "base", SyntheticRun(n_requests=40, write_summary=False))
    cand = write_run(tmp_path / "cand", SyntheticRun(n_requests=40, seed=1, write_summary=False))
    manifest = json.loads((cand / "manifest.json").read_text())
    manifest.update(complete=False, interrupted_reason="SIGINT")
    (cand / "manifest.json").write_text(json.dumps(manifest))
    # Every request sent 20 ms after its scheduled time: p99 dispatch lag above the 10 ms bound.
    table = pq.read_table(cand / "requests.parquet")
    late = pc.add(table["t_scheduled_ns"], 20_000_000)
    table = table.set_column(table.column_names.index("t_sent_ns"), "t_sent_ns", late)
    pq.write_table(table, cand / "requests.parquet")
    result = run_gate(base, cand, config=GateConfig(n_resamples=100, only=("ttft_p50_ms",)))
    assert "run cand is incomplete (SIGINT)" in result.notes
    assert any("run cand was client bound" in note for note in result.notes)
    card = build_card(cand)
    assert card.client_health.client_bound is True
    assert any("client was the bottleneck" in note for note in card.notes)


def test_goodput_needs_an_slo(tmp_path):
    base = write_run(tmp_path / "base", SyntheticRun(n_requests=40, slo=None, write_summary=False))
    cand = write_run(
        tmp_path / "cand", SyntheticRun(n_requests=40, seed=1, slo=None, write_summary=False)
    )
    config = GateConfig(n_resamples=100, only=("goodput_request_per_s", "ttft_p50_ms"))
    without = run_gate(base, cand, config=config)
    assert [r.metric for r in without.results] == ["ttft_p50_ms"]
    assert "goodput_request_per_s skipped: goodput needs an SLO (pass --slo)" in without.notes
    with_slo = run_gate(base, cand, config=config, slo_spec=slo.load_slo("p99"))
    assert [r.metric for r in with_slo.results] == ["goodput_request_per_s", "ttft_p50_ms"]
    assert with_slo.slo_name == "p99"
