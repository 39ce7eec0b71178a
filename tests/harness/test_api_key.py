"""`bench run --api-key` and `OPENAI_API_KEY` against a mock that needs a bearer token."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from click.testing import CliRunner

from harness.cli import bench

ARGS = ["--workload", "random", "--tokenizer", "tiny-random", "--input-len", "4",
        "--output-len", "2", "--num-requests", "3", "--quiet"]  # fmt: skip


def _run(url: str, out, *extra: str, env: dict | None = None):
    return CliRunner().invoke(
        bench, ["run", "--url", url, *ARGS, "--out", str(out), *extra], env=env or {}
    )


def test_api_key_flag_reaches_the_server_and_is_not_recorded(mock_server, tmp_path):
    with mock_server("--ttft-ms", "1", "--itl-ms", "1", "--api-key", "s3cret") as url:
        result = _run(url, tmp_path / "run", "--api-key", "s3cret")
    assert result.exit_code == 0, result.output
    assert set(pq.read_table(tmp_path / "run" / "requests.parquet")["status"].to_pylist()) == {"ok"}
    for name in ("manifest.json", "summary.json"):
        assert "s3cret" not in (tmp_path / "run" / name).read_text()
    assert (
        json.loads((tmp_path / "run" / "manifest.json").read_text())["config"].get("api_key")
        is None
    )


def test_openai_api_key_environment_variable_is_the_fallback(mock_server, tmp_path):
    with mock_server("--ttft-ms", "1", "--itl-ms", "1", "--api-key", "k2") as url:
        result = _run(url, tmp_path / "run", env={"OPENAI_API_KEY": "k2"})
    assert result.exit_code == 0, result.output


def test_missing_or_wrong_key_is_one_sentence_before_the_run(mock_server, tmp_path):
    with mock_server("--ttft-ms", "1", "--itl-ms", "1", "--api-key", "right") as url:
        missing = _run(url, tmp_path / "a", env={"OPENAI_API_KEY": ""})
        wrong = _run(url, tmp_path / "b", "--api-key", "wrong")
    for result, word in ((missing, "needs an API key"), (wrong, "refused the API key")):
        assert result.exit_code != 0
        assert word in str(result.exception) and "--api-key" in str(result.exception)
