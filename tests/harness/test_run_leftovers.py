"""A run refused after `bench run` started (bad workload, unreachable target) leaves nothing on
disk: no empty run directory, no `runs/` made for it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from harness.cli import bench
from harness.cli.main import _is_user_error

FAST = ["--tokenizer", "tiny-random", "--input-len", "4", "--output-len", "2", "--quiet"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "no-such-workload", "--url", "http://127.0.0.1:9/v1"], "no-such-workload"),
        (["--url", "http://127.0.0.1:9/v1", "--num-requests", "2"], "cannot reach the target"),
        (["--slo", "no-such-slo", "--url", "http://127.0.0.1:9/v1"], "no-such-slo"),
    ],
)
@pytest.mark.parametrize("out", [None, "deep/nested/run"])
def test_refused_runs_leave_no_directory(argv, message, out, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra = [] if out is None else ["--out", out]
    result = CliRunner().invoke(bench, ["run", *argv, *FAST, *extra])
    assert _is_user_error(result.exception), result.output
    assert message in str(result.exception)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_empty_out_directory_is_kept(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    result = CliRunner().invoke(bench, ["run", "--url", "http://127.0.0.1:9/v1", *FAST,
                                        "--out", str(out)])  # fmt: skip
    assert _is_user_error(result.exception)
    assert out.is_dir()  # the user's directory, not ours to remove
