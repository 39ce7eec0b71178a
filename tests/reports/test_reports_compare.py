"""Comparative cards: three runs side by side, best values marked, mismatches refused."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from rundir_builder import SyntheticRun, write_run

from reports.cli import report
from reports.compare import best_indices, compare_runs
from reports.errors import ReportError
from reports.html import render_comparison_html


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    """Engines a, b, c on one workload (c slowest, b fastest) and d on another workload."""
    root = tmp_path_factory.mktemp("cmp")
    specs = {
        "engine-a": SyntheticRun(n_requests=60, seed=1, engine="a"),
        "engine-b": SyntheticRun(n_requests=60, seed=2, engine="b", latency_scale=0.5),
        "engine-c": SyntheticRun(n_requests=60, seed=3, engine="c", latency_scale=2.0),
        "engine-d": SyntheticRun(n_requests=60, seed=4, engine="d", workload_sha256="d" * 64),
    }
    return {name: write_run(root / name, spec) for name, spec in specs.items()}


@pytest.mark.parametrize(
    ("values", "higher", "expected"),
    [
        ([1.0, 3.0, 2.0], True, [1]),
        ([1.0, 3.0, 2.0], False, [0]),
        ([2.0, None, 2.0], False, [0, 2]),  # a tie marks both
        ([None, 5.0, None], True, []),  # one value: nothing to beat
    ],
)
def test_best_indices(values, higher, expected):
    assert best_indices(values, higher_is_better=higher) == expected


def test_three_runs_side_by_side(three_runs):
    runs = [three_runs[n] for n in ("engine-a", "engine-b", "engine-c")]
    comparison = compare_runs(runs)
    assert comparison.mismatches == []
    rows = {row.key: row for row in comparison.rows}
    # Engine b has half the latency of a and c a double: b is best on every latency row.
    for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p99_ms"):
        assert rows[key].best == [1], key
        assert rows[key].values[2] > rows[key].values[0] > rows[key].values[1]
    html = render_comparison_html(comparison)
    assert html.count('class="best"') == sum(len(r.best) for r in comparison.rows)
    assert html.count("<svg") == 6 and "Mismatch allowed" not in html
    data = json.loads(comparison.to_json())
    assert data["kind"] == "comparison" and [c["run_id"] for c in data["cards"]] == [
        "engine-a",
        "engine-b",
        "engine-c",
    ]


def test_mismatched_workload_is_refused_in_one_sentence(three_runs):
    runs = [three_runs[n] for n in ("engine-a", "engine-b", "engine-d")]
    with pytest.raises(ReportError) as info:
        compare_runs(runs)
    message = str(info.value)
    assert "run engine-d used workload dddddddddddd, not aaaaaaaaaaaa as run engine-a" in message
    assert message.endswith("or pass --allow-mismatch.") and "\n" not in message


def test_mismatched_slo_is_refused(tmp_path):
    other_slo = {
        "name": "strict",
        "percentiles": [{"metric": "ttft_ms", "percentile": 50, "max_ms": 10.0}],
    }
    a = write_run(tmp_path / "a", SyntheticRun(n_requests=20, write_summary=False))
    b = write_run(tmp_path / "b", SyntheticRun(n_requests=20, slo=other_slo, write_summary=False))
    with pytest.raises(ReportError, match="judged by SLO 'strict', not 'p99'"):
        compare_runs([a, b])


def test_allow_mismatch_says_so_on_the_card(three_runs):
    runs = [three_runs[n] for n in ("engine-a", "engine-b", "engine-d")]
    comparison = compare_runs(runs, allow_mismatch=True)
    assert len(comparison.mismatches) == 1
    html = render_comparison_html(comparison)
    assert "Mismatch allowed (--allow-mismatch):" in html and "run engine-d used workload" in html
    assert json.loads(comparison.to_json())["mismatches"] == comparison.mismatches


def test_report_cli_three_runs(three_runs, tmp_path):
    runs = [str(three_runs[n]) for n in ("engine-a", "engine-b", "engine-d")]
    out_html, out_json = tmp_path / "card.html", tmp_path / "card.json"
    refused = CliRunner().invoke(report, [*runs, "-o", str(out_html)])
    assert (
        refused.exit_code == 2 and "Error: Refusing to compare runs that differ" in refused.output
    )
    assert "Traceback" not in refused.output and not out_html.exists()
    allowed = CliRunner().invoke(
        report, [*runs, "-o", str(out_html), "--json", str(out_json), "--allow-mismatch"]
    )
    assert allowed.exit_code == 0, allowed.output
    assert "Mismatch allowed" in out_html.read_text()
    assert json.loads(out_json.read_text())["schema_version"] == 1


def test_report_cli_one_run(three_runs, tmp_path):
    out_html, out_json = tmp_path / "card.html", tmp_path / "card.json"
    result = CliRunner().invoke(
        report, [str(three_runs["engine-a"]), "-o", str(out_html), "--json", str(out_json)]
    )
    assert result.exit_code == 0, result.output
    assert "Report card engine-a" in result.output
    assert out_html.read_text().startswith("<!DOCTYPE html>")
    assert json.loads(out_json.read_text())["kind"] == "run"


def test_report_cli_not_a_run_directory(tmp_path):
    result = CliRunner().invoke(report, [str(tmp_path)])
    assert result.exit_code == 2 and "has no manifest.json" in result.output
