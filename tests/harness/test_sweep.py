"""`bench sweep` end to end against the mock: one run per point, one target, the card."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from harness.cli import bench
from harness.cli.main import _is_user_error
from harness.errors import HarnessError
from harness.run.sweep import SweepPlan

FAST = ["--tokenizer", "tiny-random", "--input-len", "4", "--output-len", "8",
        "--num-requests", "12"]  # fmt: skip


def test_concurrency_sweep_with_repeats_writes_runs_and_card(mock_server, tmp_path):
    with mock_server("--ttft-ms", "5", "--itl-ms", "1", "--max-concurrency", "2") as url:
        result = CliRunner().invoke(bench, ["sweep", "--url", url, *FAST, "--concurrency",
                                            "1,4", "--repeat", "2", "--slo", "p99",
                                            "--out", str(tmp_path / "sw")])  # fmt: skip
    assert result.exit_code == 0, result.output
    sweep = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    names = [p["run_dir"] for p in sweep["points"]]
    assert names == ["point-00-1users-rep1", "point-00-1users-rep2",
                     "point-01-4users-rep1", "point-01-4users-rep2"]  # fmt: skip
    for name, users in zip(names, (1, 1, 4, 4), strict=True):
        manifest = json.loads((tmp_path / "sw" / name / "manifest.json").read_text())
        assert manifest["config"]["concurrency"] == users and manifest["complete"] is True
        assert manifest["target"]["url"] == url  # one target for every point
    card = json.loads((tmp_path / "sw" / "sweep_card.json").read_text())
    assert [p["value"] for p in card["points"]] == [1, 1, 4, 4]
    assert all(p["goodput_request_per_s"] is not None for p in card["points"])
    assert "<svg" in (tmp_path / "sw" / "sweep.html").read_text()


def test_rate_sweep_runs_each_rate(mock_server, tmp_path):
    with mock_server("--ttft-ms", "2", "--itl-ms", "1") as url:
        result = CliRunner().invoke(bench, ["sweep", "--url", url, *FAST, "--request-rate",
                                            "5,inf", "--out", str(tmp_path / "sw")])  # fmt: skip
    assert result.exit_code == 0, result.output
    rates = [
        json.loads((tmp_path / "sw" / p["run_dir"] / "manifest.json").read_text())["config"][
            "request_rate"
        ]
        for p in json.loads((tmp_path / "sw" / "sweep.json").read_text())["points"]
    ]
    assert rates == [5.0, "inf"]


@pytest.mark.parametrize(
    ("kind", "text", "expected"),
    [
        ("request_rate", "1,2.5, inf", (1.0, 2.5, math.inf)),
        ("concurrency", "1,4,16,64", (1, 4, 16, 64)),
        ("concurrency", "8", (8,)),
    ],
)
def test_plan_parsing(kind, text, expected):
    assert SweepPlan.parse(kind, text).values == expected


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("concurrency", "1,2.5", "whole numbers of at least 1"),
        ("concurrency", "0", "whole numbers of at least 1"),
        ("request_rate", "-1", "numbers above 0"),
        ("request_rate", "a,b", "comma list of numbers"),
        ("request_rate", "nan", "numbers above 0"),
    ],
)
def test_bad_plans_are_one_sentence(kind, text, message):
    with pytest.raises(HarnessError, match=message):
        SweepPlan.parse(kind, text)


def test_plan_needs_a_repeat_of_at_least_one():
    with pytest.raises(HarnessError, match="--repeat"):
        SweepPlan("concurrency", (1,), repeat=0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "needs one of --request-rate LIST or --concurrency LIST"),
        (["--concurrency", "1", "--request-rate", "2"], "needs one of"),
        (["--concurrency", "1,x"], "comma list of numbers"),
        (["--concurrency", "1", "--url", "http://127.0.0.1:9/v1"], "cannot reach the target"),
    ],
)
def test_refused_sweeps_leave_nothing(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(bench, ["sweep", *FAST, *argv])
    assert _is_user_error(result.exception), result.output
    assert message in str(result.exception)
    assert list(tmp_path.iterdir()) == []
