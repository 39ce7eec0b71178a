"""benchmarks/gpu_check.py's CPU path end to end (tiny shapes): the JSON it writes, its
equality check failing for a device side that computes differently, and its one sentence
when CUDA is asked for and absent."""

from __future__ import annotations

import json

import pytest
import torch
from benchmark_scripts import load_benchmark

gpu_check = load_benchmark("gpu_check")
TINY = ["--device", "cpu", "--shape", "tiny", "--steps", "3", "--batches", "1,4", "--threads", "1"]


def run_main(tmp_path, *extra: str) -> tuple[int, dict]:
    path = tmp_path / "gpu.json"
    code = gpu_check.main([*TINY, "--max-tokens", "12", "--json", str(path), *extra])
    return code, json.loads(path.read_text())


def test_cpu_path_writes_equality_speed_and_floor(tmp_path):
    code, result = run_main(tmp_path)
    assert code == 0 and result["errors"] == {}
    equality = result["equality"]
    assert equality["greedy_equal"] is True
    assert equality["prompts"] == list(gpu_check.EQUALITY_PROMPTS)
    assert set(equality["models"]) == {"tiny-random", "tiny-random-varied"}
    for model in equality["models"].values():
        assert [row["tokens"] for row in model["prompts"]] == [12] * len(gpu_check.EQUALITY_PROMPTS)
    for b in ("1", "4"):
        assert result["speed"][b]["tok_s"] > 0 and result["speed"][b]["steps"] == 3
        assert result["floor"][b]["floor_ms"] > 0 and result["floor"][b]["floor_tflops"] > 0


def test_bf16_device_side_is_reported_unequal(tmp_path):
    """Negative control: the device engine in bfloat16 against the float32 CPU engine. On the
    varied model bf16 rounding changes greedy tokens, which the check must report."""
    code, result = run_main(tmp_path, "--device-dtype", "bfloat16")
    assert code == 1
    varied = result["equality"]["models"]["tiny-random-varied"]
    assert result["equality"]["greedy_equal"] is False and varied["equal"] is False
    differing = [row for row in varied["prompts"] if not row["equal"]]
    assert all(row["first_divergence"] is not None for row in differing)
    assert all(row["cpu_top2_margin_at_divergence"] >= 0 for row in differing)


def test_compare_finds_the_first_differing_token():
    """Hand-made runs: (token, {token: logprob}) per step."""
    ref = [[(5, {5: -0.1, 6: -2.5}), (7, {7: -0.2, 8: -0.9}), (9, {9: -0.3, 1: -1.0})]]
    same = [[(5, {5: -0.1, 6: -2.5}), (7, {7: -0.25, 8: -0.9}), (9, {9: -0.3, 1: -1.0})]]
    other = [[(5, {5: -0.1, 6: -2.5}), (8, {8: -0.5, 7: -0.6}), (9, {9: -0.3, 1: -1.0})]]
    equal = gpu_check.compare(ref, same, ["p"])
    assert equal["equal"] and equal["prompts"][0]["max_abs_logprob_diff"] == pytest.approx(0.05)
    row = gpu_check.compare(ref, other, ["p"])["prompts"][0]
    assert (row["equal"], row["first_divergence"]) == (False, 1)
    assert row["cpu_top2_margin_at_divergence"] == pytest.approx(0.7)
    assert row["max_abs_logprob_diff"] == 0.0  # over the common prefix (token 0) only


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_missing_cuda_is_one_sentence(capsys):
    assert gpu_check.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("CUDA was asked for") and err.count("\n") == 0
