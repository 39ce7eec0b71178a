"""The sweep card: points from the runs' summaries, the Pareto frontier, the HTML page."""

from __future__ import annotations

import json

import pytest
from rundir_builder import SyntheticRun, write_run

from reports.errors import ReportError
from reports.sweep import build_sweep_card, pareto_frontier
from reports.sweep_html import render_sweep_html


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        ([(1, 5), (2, 4), (3, 3)], [True, True, True]),  # a trade-off: all on the frontier
        ([(1, 1), (2, 2)], [False, True]),  # dominated on both
        ([(2, 2), (2, 2)], [True, True]),  # equal points dominate neither
        ([(2, 3), (2, 2)], [True, False]),  # equal x, better y
        ([(1, None), (None, 1), (1, 1)], [False, False, True]),
        ([], []),
    ],
)
def test_pareto_frontier_by_hand(points, expected):
    assert pareto_frontier(points) == expected


def _sweep(tmp_path, scales):
    """A sweep directory of synthetic runs whose latencies grow with load."""
    root = tmp_path / "sweep"
    points = []
    for i, (value, scale) in enumerate(scales):
        name = f"point-{i:02d}-{value}users"
        write_run(root / name, SyntheticRun(n_requests=40, seed=i, latency_scale=scale,
                                            rate_per_s=4.0 * value))  # fmt: skip
        points.append({"kind": "concurrency", "value": value, "repeat": 1, "run_dir": name,
                       "complete": True, "exit_code": 0})  # fmt: skip
    (root / "sweep.json").write_text(json.dumps({"version": 1, "kind": "concurrency",
                                                 "points": points, "slo": None}))  # fmt: skip
    return root


def test_sweep_card_points_come_from_the_summaries(tmp_path):
    root = _sweep(tmp_path, [(1, 1.0), (4, 1.5), (16, 3.0)])
    card = build_sweep_card(root)
    assert [p.value for p in card.points] == [1, 4, 16]
    summary = json.loads((root / "point-01-4users" / "summary.json").read_text())
    p = card.points[1]
    assert p.ttft_p99_ms == summary["latency_ms"]["ttft"]["p99"]
    assert p.output_tokens_per_s == summary["throughput"]["output_tokens_per_s"]
    assert p.output_tokens_per_s_per_user == pytest.approx(
        1000 / summary["latency_ms"]["tpot"]["p50"]
    )
    expected = pareto_frontier(
        [(q.output_tokens_per_s, q.output_tokens_per_s_per_user) for q in card.points]
    )
    assert [q.on_frontier for q in card.points] == expected
    assert json.loads(card.to_json())["points"][0]["run_dir"] == "point-00-1users"


def test_sweep_html_has_the_pareto_chart_and_table(tmp_path):
    html = render_sweep_html(build_sweep_card(_sweep(tmp_path, [(1, 1.0), (2, 1.2), (4, 2.0)])))
    assert html.count("<svg") == 2
    assert "Throughput against interactivity (Pareto)" in html
    assert "point-02-4users" in html and "tokens/s per user" in html
    assert "http" not in html.split("Content-Security-Policy")[1].split(">")[0]


def test_not_a_sweep_directory_is_one_sentence(tmp_path):
    with pytest.raises(ReportError, match="holds no readable sweep.json"):
        build_sweep_card(tmp_path)
    (tmp_path / "sweep.json").write_text(json.dumps({"kind": "concurrency", "points": []}))
    with pytest.raises(ReportError, match="no finished point"):
        build_sweep_card(tmp_path)
