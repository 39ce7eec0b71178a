"""benchmarks/step_profile.py on tiny-random (bfloat16, so every decode step runs the Python
layers): the decode-attention kernel's time lands in attention, the torch path's matmuls there
too and not among the weight GEMMs, and the parts never exceed the step."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from benchmark_scripts import BENCHMARKS

from engine_ref.core import kernels


def _load_step_profile():
    # Registered in sys.modules before it runs: its dataclass looks its module up there
    # (`benchmark_scripts.load_benchmark` does not register the modules it loads).
    spec = importlib.util.spec_from_file_location("step_profile_benchmark",
                                                  BENCHMARKS / "step_profile.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not kernels.available(), reason="engine kernels off")
def test_a_tiny_compare_run_puts_each_op_where_it_belongs(tmp_path):
    bench = _load_step_profile()
    out = tmp_path / "profile.json"
    # More rows than the fused decode layer takes (bf16 fuses up to DENSE_SMALL_BATCH_ROWS).
    rows = str(kernels.DENSE_SMALL_BATCH_ROWS + 1)
    args = ["--model", "tiny-random", "--dtype", "bfloat16", "--num-requests", rows,
            "--input-len", "6", "--output-len", "24", "--timed-steps", "2", "--steps", "2",
            "--threads", "1", "--compare", "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    kernel, torch_path = report["variants"]["kernel"], report["variants"]["torch"]
    assert set(kernel["attention_ops_by_name_ms"]) >= {"refkern::paged_attention_decode"}
    assert "aten::bmm" not in kernel["attention_ops_by_name_ms"]
    assert "aten::bmm" in torch_path["attention_ops_by_name_ms"]
    assert "refkern::paged_attention_decode" not in torch_path["attention_ops_by_name_ms"]
    for split in (kernel, torch_path):
        assert not {"aten::bmm", "aten::mm"} & set(split["other_ops_by_name_ms"])
        assert split["gemm_ms"] > 0 and split["attention_ops_ms"] <= split["attention_ms"]
        parts = split["gemm_ms"] + split["attention_ms"] + split["other_ops_ms"]
        assert parts <= split["step_ms"] * 1.001
        assert set(split["phases_ms"]) >= {"schedule", "metadata", "model", "logits", "sample"}
