"""Comparative runs: interleaved order, one run directory per target and repetition, one
comparative card with n, interval and ratio per row; driven through `bench run`."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from harness.cli import bench
from harness.errors import HarnessError
from harness.run.comparative import interleaved, target_labels


@pytest.mark.parametrize(
    ("targets", "repeat", "expected"),
    [
        (["A"], 1, [(0, "A")]),
        (["A", "B"], 1, [(0, "A"), (0, "B")]),
        (["A", "B"], 3, [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]),
        (["A", "B", "C"], 2, [(0, "A"), (0, "B"), (0, "C"), (1, "C"), (1, "B"), (1, "A")]),
    ],
)
def test_interleaved_order_cancels_drift(targets, repeat, expected):
    assert interleaved(targets, repeat) == expected


@pytest.mark.parametrize(("targets", "repeat"), [([], 1), (["A"], 0)])
def test_interleaved_refuses_nothing_to_run(targets, repeat):
    with pytest.raises(HarnessError):
        interleaved(targets, repeat)


def test_target_labels_are_unique():
    assert target_labels(["ref", "url:http://a:1/v1", "url:http://b:2/v1", "vllm"]) == [
        "ref",
        "url",
        "url-2",
        "vllm",
    ]


@pytest.mark.slow
def test_bench_run_two_targets_repeated(tmp_path, private_cache):
    from tests.harness.conftest import mock_server_process

    out = tmp_path / "cmp"
    with mock_server_process("--model", "m", "--ttft-ms", "5", "--itl-ms", "1") as url_a:
        with mock_server_process("--model", "m", "--ttft-ms", "40", "--itl-ms", "1") as url_b:
            result = CliRunner().invoke(
                bench,
                ["run", "--target", f"url:{url_a}", "--target", f"url:{url_b}", "--repeat", "2",
                 "--tokenizer", "tiny-random", "--workload", "random", "--num-requests", "6",
                 "--input-len", "8", "--output-len", "4", "--request-rate", "inf",
                 "--out", str(out)],
            )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "url-2-r1",
        "url-2-r2",
        "url-r1",
        "url-r2",
    ]
    card = json.loads((out / "comparison.json").read_text())
    assert card["kind"] == "repeated_comparison"
    assert card["order"] == ["url-r1", "url-2-r1", "url-2-r2", "url-r2"]
    ttft = next(r for r in card["rows"] if r["key"] == "ttft_p50_ms")
    first, second = ttft["stats"]
    assert first["n"] == second["n"] == 2 and first["ratio"] == 1.0
    assert second["ratio"] > 2  # 40 ms against 5 ms to the first token
    assert first["ci_low"] <= first["mean"] <= first["ci_high"]
    assert "url-2" in (out / "comparison.html").read_text()
    assert "| TTFT p50 (ms) |" in (out / "comparison.md").read_text()
    assert "comparative card:" in result.output
