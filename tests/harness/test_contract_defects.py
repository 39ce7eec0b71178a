"""The two defects the run-record contract fixed, each through the public path a user takes:
`bench run` against a live mock, then `bench report` on what it wrote."""

from __future__ import annotations

import json
import urllib.request

from click.testing import CliRunner

from harness.cli import bench

FAST = ["--tokenizer", "tiny-random", "--input-len", "8", "--output-len", "4", "--quiet"]


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/stats", timeout=5) as resp:
        return json.loads(resp.read())


def test_client_counted_tokens_put_the_note_on_the_card(mock_server, tmp_path):
    """A server that reports no usage: tokens are counted by the client, and the card says so.
    (Before the contract, the harness wrote `tokenizer` and the card looked for `client_count`.)"""
    run = tmp_path / "run"
    with mock_server("--ttft-ms", "1", "--itl-ms", "1", "--no-usage") as url:
        result = CliRunner().invoke(bench, ["run", "--url", url, "--workload", "random", *FAST,
                                            "--num-requests", "6", "--out", str(run)])  # fmt: skip
    assert result.exit_code == 0, result.output
    card_json = tmp_path / "card.json"
    result = CliRunner().invoke(bench, ["report", str(run), "--json", str(card_json)])
    assert result.exit_code == 0, result.output
    card = json.loads(card_json.read_text())
    notes = " ".join(card["notes"])
    assert "counted by the client" in notes
    summary = json.loads((run / "summary.json").read_text())
    assert summary["output_tokens_source"] == "tokenizer"


def test_with_usage_the_card_has_no_client_count_note(mock_server, tmp_path):
    run = tmp_path / "run"
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        result = CliRunner().invoke(bench, ["run", "--url", url, "--workload", "random", *FAST,
                                            "--num-requests", "4", "--out", str(run)])  # fmt: skip
    assert result.exit_code == 0, result.output
    card_json = tmp_path / "card.json"
    assert CliRunner().invoke(bench, ["report", str(run), "--json", str(card_json)]).exit_code == 0
    card = json.loads(card_json.read_text())
    notes = " ".join(card["notes"])
    assert "counted by the client" not in notes


CHAT_SPEC = """\
name: chat-spec
num_requests: 3
seed: 0
ignore_eos: true
endpoint: chat
source:
  kind: synthetic
  input: {dist: fixed, value: 8}
  output: {dist: fixed, value: 4}
arrivals:
  process: all_at_once
"""


def test_workload_spec_endpoint_chat_drives_chat_completions(mock_server, tmp_path):
    spec = tmp_path / "chat-spec.yaml"
    spec.write_text(CHAT_SPEC)
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        result = CliRunner().invoke(bench, ["run", "--url", url, "--workload", str(spec),
                                            "--tokenizer", "tiny-random", "--quiet",
                                            "--out", str(tmp_path / "run")])  # fmt: skip
        served = _stats(url)["requests_by_path"]
    assert result.exit_code == 0, result.output
    assert served == {"/v1/chat/completions": 3}
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["target"]["endpoint"] == "chat"


def test_endpoint_flag_overrides_the_workload_spec(mock_server, tmp_path):
    spec = tmp_path / "chat-spec.yaml"
    spec.write_text(CHAT_SPEC)
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        result = CliRunner().invoke(bench, ["run", "--url", url, "--workload", str(spec),
                                            "--endpoint", "completions", "--tokenizer",
                                            "tiny-random", "--quiet",
                                            "--out", str(tmp_path / "run")])  # fmt: skip
        served = _stats(url)["requests_by_path"]
    assert result.exit_code == 0, result.output
    assert served == {"/v1/completions": 3}
