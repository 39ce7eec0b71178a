"""`dtype="auto"`: bf16 only where the hardware multiplies it natively."""

from __future__ import annotations

import pytest
import torch

from engine_ref import EngineConfig
from engine_ref.core import engine_config
from engine_ref.core.engine_config import cpu_has_fast_bf16

AVX2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n"


@pytest.mark.parametrize(
    ("cpuinfo", "fast"), [(AVX2, False), (BF16, True), (AMX, True), ("", False)]
)
def test_cpu_flags_decide(cpuinfo, fast):
    assert cpu_has_fast_bf16(cpuinfo) is fast


@pytest.mark.parametrize(("fast", "dtype"), [(False, torch.float32), (True, torch.bfloat16)])
def test_auto_dtype_on_cpu(monkeypatch, fast, dtype):
    monkeypatch.setattr(engine_config, "cpu_has_fast_bf16", lambda: fast)
    assert EngineConfig(model="tiny-random", device="cpu").torch_dtype() == dtype
    assert (
        EngineConfig(model="tiny-random", device="cpu", dtype="bfloat16").torch_dtype()
        == torch.bfloat16
    )
    assert (
        EngineConfig(model="tiny-random", device="cpu", dtype="float32").torch_dtype()
        == torch.float32
    )
