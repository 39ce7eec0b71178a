"""What `bench run` prints (its console card, not --quiet) and what `bench report` writes for
the same run, through the CLI against the mock server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FAST = ["--tokenizer", "tiny-random", "--workload", "random", "--input-len", "16"]
CHUNK_SENTENCE = "TPOT is per token, ITL per chunk"


def bench(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "harness.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=cwd)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "no-stream"])
def test_the_chunk_sentence_is_said_only_of_streamed_runs(tmp_path, mock_server, stream):
    """A non-streamed answer arrives as one piece: it has no chunks, ITL or TPOT, so the card
    does not relate them (it said "chunks carried 16 tokens ... ITL is about 16x TPOT")."""
    run = tmp_path / "run"
    flags = [] if stream else ["--no-stream"]
    with mock_server("--ttft-ms", "2", "--itl-ms", "2") as url:
        result = bench("run", "--url", url, *FAST, "--output-len", "16", "--num-requests", "4",
                       "--request-rate", "inf", "--out", str(run), *flags)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = bench("report", str(run), "-o", "card.html", cwd=tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr
    html = (tmp_path / "card.html").read_text()
    for text in (result.stdout, report.stdout, html):
        assert (CHUNK_SENTENCE in text) is stream
        assert ("chunks carried" in text) is stream
