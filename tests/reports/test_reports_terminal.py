"""`bench report` piped into a file or a CI log (no terminal, no COLUMNS): rich would assume
80 columns and cut table cells ('…') or wrap them mid-word; the tables are printed at their
natural width instead, each row on one line."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from rundir_builder import SyntheticRun, write_run

from reports.terminal import PIPED_WIDTH, cli_console

VLLM_TPOT = "(latency - ttft) / (output_len - 1), per request"


def piped_bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    cmd = [sys.executable, "-m", "harness.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def cut_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "…" in line]


def test_the_conventions_table_is_whole_when_piped(golden_run):
    result = piped_bench("report", str(golden_run), "--conventions")
    assert result.returncode == 0, result.stderr
    assert cut_lines(result.stdout) == []
    rows = result.stdout.splitlines()
    assert any("tpot" in row and VLLM_TPOT in row for row in rows)
    assert any("output_tokens_per_s" in row and "tokens/s" in row for row in rows)


def test_fault_names_are_whole_when_piped(tmp_path):
    window = {"start_s": 2.0, "end_s": 4.0, "kind": "disconnect_storm"}
    run = write_run(
        tmp_path / "r",
        SyntheticRun(
            n_requests=60, failures={"cancelled": 6, "timeout": 2}, fault_windows=[window]
        ),
    )
    result = piped_bench("report", str(run))
    assert result.returncode == 0, result.stderr
    assert cut_lines(result.stdout) == []
    header = [line for line in result.stdout.splitlines() if "fault" in line and "from s" in line]
    assert (
        len(header) == 1 and "recovered after s" in header[0] and "outcomes in window" in header[0]
    )
    row = [line for line in result.stdout.splitlines() if "disconnect_storm" in line]
    assert len(row) == 1 and "2.00" in row[0] and "4.00" in row[0]


def test_the_console_is_piped_width_only_without_a_terminal_or_columns(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # not a terminal
    monkeypatch.delenv("COLUMNS", raising=False)
    assert cli_console().width == PIPED_WIDTH
    monkeypatch.setenv("COLUMNS", "100")
    assert cli_console().width == 100
