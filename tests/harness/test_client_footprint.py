"""The client process stays light: `bench run` against an external target counts tokens with
the model's tokenizer without importing torch (about 170 MB of resident memory and seconds of
start-up that a load generator has no use for)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Runs `bench run` through its click entry point in a fresh interpreter, then reports whether
# torch was ever imported (the exit code of `bench run` is kept).
_PROBE = textwrap.dedent(
    """
    import json, sys
    from harness.cli import bench
    try:
        bench.main(sys.argv[1:], standalone_mode=False)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
    """
)


@pytest.mark.parametrize("tokenizer", ["tiny-random", "smollm2-135m"])
def test_bench_run_against_a_url_never_imports_torch(mock_server, tmp_path, tokenizer):
    with mock_server("--ttft-ms", "1", "--itl-ms", "0") as url:
        argv = [
            "run", "--url", url, "--model", "mock", "--workload", "random",
            "--input-len", "8", "--output-len", "4", "--num-requests", "3",
            "--request-rate", "inf", "--tokenizer", tokenizer,
            "--out", str(tmp_path / "run"), "--quiet",
        ]  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120
        )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["code"] == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "summary.json").exists()
    assert report["torch"] is False
