"""Real vLLM (CPU build) and llama.cpp against the reference engine on the same weights, with
the output oracle. Each runs only when its venv's Python is named by an environment variable
(`BENCH_VLLM_PYTHON`, `BENCH_LLAMACPP_PYTHON`; see README "External engines")."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from harness.cli import bench

pytestmark = pytest.mark.slow

PROMPTS = ["--workload", "random", "--num-requests", "5", "--input-len", "32", "--output-len",
           "16", "--request-rate", "inf", "--check-outputs", "--diverge-before", "16"]  # fmt: skip


def _python(variable: str) -> str:
    path = os.environ.get(variable)
    if not path or not os.path.exists(path):
        pytest.skip(f"{variable} does not name the Python of a venv with the engine installed")
    return path


def _correctness(tmp_path, target: str, python: str, smollm2_path) -> dict:
    out = tmp_path / target
    result = CliRunner().invoke(
        bench,
        ["run", "--target", target, "--engine-python", f"{target}={python}", "--model",
         "smollm2-135m", "--startup-timeout", "900", "--out", str(out), "--quiet", *PROMPTS],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads((out / "summary.json").read_text())["correctness"]


def test_vllm_greedy_outputs_equal_the_reference_engine(tmp_path, smollm2_path):
    correctness = _correctness(tmp_path, "vllm", _python("BENCH_VLLM_PYTHON"), smollm2_path)
    assert correctness["n_compared"] == 5
    assert correctness["n_exact"] == 5, correctness


def test_llamacpp_agreement_on_the_gguf_file(tmp_path, smollm2_path):
    # llama.cpp computes with the 4-bit weights the reference engine dequantises: outputs may
    # differ, so the agreement is reported, not asserted equal.
    correctness = _correctness(tmp_path, "llamacpp", _python("BENCH_LLAMACPP_PYTHON"), smollm2_path)
    assert correctness["n_compared"] == 5
    print(f"llama.cpp agreement with the reference engine: {correctness['agreement_mean']:.3f}")
