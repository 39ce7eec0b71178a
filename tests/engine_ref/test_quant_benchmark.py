"""benchmarks/quantization.py: its agreement measure on a hand case, and one tiny run of the
whole script (every mode, speed, quality and step split) on tiny-random."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_benchmark

from engine_ref.core import kernels


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("quantization")


def test_agreement_hand_case(bench):
    baseline = [[1, 2, 3, 4], [5, 6, 7, 8]]
    other = [[1, 2, 9, 4], [5, 6, 7, 8]]  # diverges at position 2, equal again at 3
    assert bench.agreement(baseline, other) == {
        "mean_identical_prefix": 3.0,  # (2 + 4) / 2
        "equal_positions": 7 / 8,
    }
    assert bench.agreement([[]], [[]]) == {"mean_identical_prefix": 0, "equal_positions": 1.0}


@pytest.mark.slow  # builds four engines and runs every section (~1 min on a busy 2-core box)
def test_tiny_run_reports_every_mode(bench, tmp_path, capsys):
    out = tmp_path / "q.json"
    modes = "float32,float32-torch,w4a16,w4a16-torch,w8a16,w8a8"
    args = ["--model", "tiny-random", "--modes", modes, "--repeats", "2",
            "--decode-tokens", "4", "--batch", "3", "--batch-input-len", "5",
            "--batch-output-len", "3", "--quality-prompts", "4", "--quality-tokens", "6",
            "--profile", "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    base = report["modes"]["float32"]
    assert base["quality"]["equal_positions"] == 1.0 and base["decode_speedup"] == 1.0
    for mode in ("w4a16", "w4a16-torch", "w8a16", "w8a8"):
        row = report["modes"][mode]
        assert row["streamed_bytes"] < base["streamed_bytes"]
        assert row["bytes_bound"] == base["streamed_bytes"] / row["streamed_bytes"]
        assert 0 <= row["quality"]["equal_positions"] <= 1 and row["quality"]["perplexity"] > 1
        assert len(row["runs"]["decode_tok_s"]) == 2
        assert 0 < row["step_split"]["gemm_ms"] < row["step_split"]["step_ms"]
    # A single-row step reads one copy of the int4 weights: the engine kernels' (float16 scale
    # and minimum: 20 B per 32) where they run, torch's (bf16 scale and zero: 20 B) otherwise;
    # the int8 output projection's rows either way, with float32 scales (engine) or bf16.
    w4, w4_torch = report["modes"]["w4a16"], report["modes"]["w4a16-torch"]
    vocab = 512  # tiny-random
    extra = vocab * 2 if kernels.available() else 0
    assert w4["streamed_bytes"] == w4_torch["streamed_bytes"] + extra
    # float32 on torch's kernels reads the same bytes, so its bound is 1; both step splits
    # count their weight GEMMs (the engine's f32_gemm, or torch's mm).
    dense_torch = report["modes"]["float32-torch"]
    assert dense_torch["streamed_bytes"] == base["streamed_bytes"]
    assert dense_torch["quality"]["equal_positions"] > 0.9
    for row in (base, dense_torch):
        assert 0 < row["step_split"]["gemm_ms"] < row["step_split"]["step_ms"]
    assert "of bound" in capsys.readouterr().out


def test_modes_must_include_the_baseline(bench):
    with pytest.raises(SystemExit):
        bench.main(["--modes", "w4a16"])
