"""The int8-activation GEMMs (`kernels/int8.cpp`): their layouts by hand, both against a
float64 product of the same quantised operands (activations quantised here, independently,
by the rule the kernels state) across the row passes, block tails and K tails, zero rows,
outlier rows and the extreme integer sums, a row's result independent of its batch, and the
same bits at the AVX2 level as at this CPU's best (a subprocess with BENCH_REF_ISA=avx2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine_ref.core import kernels
from engine_ref.core.kernels import int8
from engine_ref.core.quant import Int4Groups, int8_per_row

needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"engine kernels off: {kernels.unavailable_reason()}"
)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, K] float64 integers within +-127, a [M, 1] float64): a = amax / 127 in float32
    (1 for a zero row), xq = round-half-even(x / a) in float32."""
    amax = x.abs().amax(dim=1, keepdim=True)
    a = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round((x / a).clamp(-127, 127)).double(), a.double()


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 (a xq) @ weight.T for float64 weight [N, K]."""
    xq, a = quantize_rows(x)
    return (a * xq) @ weight.t()


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def groups(n: int, k: int, seed: int) -> Int4Groups:
    return Int4Groups.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))


def q4_i8(x: torch.Tensor, g: Int4Groups) -> torch.Tensor:
    return int8.q4_i8_gemm(x, int8.pack_q4_i8(g.q, g.scale, g.minimum), g.shape[0])


def q8_i8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return int8.q8_i8_gemm(x, int8.pack_q8_i8(q, scale), q.shape[0])


def int8_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double().unsqueeze(1)


# -- layouts ------------------------------------------------------------------------------------


def test_pack_q4_i8_hand_case():
    # One row, one group, q[k] = k % 16: byte b of run t holds q[8 t + b] | q[8 t + 4 + b] << 4.
    q = (torch.arange(32) % 16).to(torch.uint8).view(1, 32)
    scale, minimum = torch.tensor([[0.5]]), torch.tensor([[-2.0]])
    packed = int8.pack_q4_i8(q, scale, minimum)
    assert packed.shape == (1, 320) and packed.dtype == torch.uint8
    runs = packed[0, :256].view(4, 16, 4)  # [t, row, b]
    assert runs[0, 0].tolist() == [0x40, 0x51, 0x62, 0x73]  # q 0..3 low, 4..7 high
    assert runs[1, 0].tolist() == [0xC8, 0xD9, 0xEA, 0xFB]  # q 8..11 low, 12..15 high
    assert runs[2, 0].tolist() == [0x40, 0x51, 0x62, 0x73]  # q 16..19 = 0..3 again
    assert int(runs[:, 1:].abs().sum()) == 0  # rows 1..15 pad the block
    halves = packed[0, 256:].view(torch.float16)
    assert halves[0] == 0.5 and halves[16] == -2.0 and int(halves[1:16].abs().sum()) == 0


def test_pack_q8_i8_hand_case():
    # One row, K = 5: two runs of 4 inputs (the second padded), then scale and row sum.
    weight = torch.tensor([[1, -2, 3, -4, 5]], dtype=torch.int8)
    packed = int8.pack_q8_i8(weight, torch.tensor([0.25]))
    assert packed.shape == (1, 2 * 64 + 128) and packed.dtype == torch.int8
    runs = packed[0, :128].view(2, 16, 4)
    assert runs[0, 0].tolist() == [1, -2, 3, -4] and runs[1, 0].tolist() == [5, 0, 0, 0]
    assert int(runs[:, 1:].abs().sum()) == 0
    assert float(packed[0, 128:192].view(torch.float32)[0]) == 0.25
    assert packed[0, 192:].view(torch.int32).tolist()[:2] == [3, 0]


def test_pack_rejects_bad_shapes_in_one_sentence():
    with pytest.raises(ValueError, match="K a multiple of 32"):
        int8.pack_q4_i8(torch.zeros(2, 48, dtype=torch.uint8), torch.ones(2, 1), torch.ones(2, 1))
    with pytest.raises(ValueError, match=r"scale \[N\]"):
        int8.pack_q8_i8(torch.zeros(2, 8, dtype=torch.int8), torch.ones(3))
    with pytest.raises(ValueError, match="within \\+-127"):
        int8.pack_q8_i8(torch.full((1, 4), -128, dtype=torch.int8), torch.ones(1))


# -- against float64 ----------------------------------------------------------------------------

# Rows: 1, the AVX2 pass (4) and one more, the AVX-512 pass (8) and one more, 17 (three
# passes). Output rows: one, a block, a block and one, two blocks and one (a pair and a tail).
ROWS = [1, 4, 5, 8, 9, 17]
OUTPUTS = [1, 16, 17, 33]


@needs_kernels
@pytest.mark.parametrize("k", [32, 576])
@pytest.mark.parametrize("n", OUTPUTS)
@pytest.mark.parametrize("m", ROWS)
def test_q4_i8_gemm_matches_float64(m, n, k):
    g = groups(n, k, seed=m * 100 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = q4_i8(x, g)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert relative_error(y, reference(x, g.dequantize().double())) < 1e-6


@needs_kernels
@pytest.mark.parametrize("k", [1, 3, 4, 5, 64, 576])
@pytest.mark.parametrize("n", OUTPUTS)
@pytest.mark.parametrize("m", ROWS)
def test_q8_i8_gemm_matches_float64(m, n, k):
    gen = torch.Generator().manual_seed(m * 100 + n * 10 + k)
    q, scale = int8_per_row(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen)
    y = q8_i8(x, q, scale)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert relative_error(y, reference(x, int8_weight(q, scale))) < 1e-6


@needs_kernels
def test_a_large_call_matches_float64():
    # 100 rows (12 passes of 8, 25 of 4) through SmolLM2's down_proj shape.
    g = groups(576, 1536, seed=7)
    q, scale = int8_per_row(torch.randn(576, 1536, generator=torch.Generator().manual_seed(8)))
    x = torch.randn(100, 1536, generator=torch.Generator().manual_seed(9))
    assert relative_error(q4_i8(x, g), reference(x, g.dequantize().double())) < 1e-6
    assert relative_error(q8_i8(x, q, scale), reference(x, int8_weight(q, scale))) < 1e-6


def test_the_reference_tells_int8_activations_from_float_ones():
    # Negative control for the checks above: the float-activation product is far off the
    # bound they use, so a kernel that skipped the activation quantisation would fail them.
    g = groups(16, 576, seed=1)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(2))
    weight = g.dequantize().double()
    assert relative_error((x.double() @ weight.t()).float(), reference(x, weight)) > 1e-3


@needs_kernels
def test_zero_rows_give_zero_and_rows_do_not_depend_on_their_batch():
    g = groups(40, 576, seed=3)
    q, scale = int8_per_row(torch.randn(40, 576, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(5))
    x[0] = 0
    x[6] = 0
    for run in (lambda rows: q4_i8(rows, g), lambda rows: q8_i8(rows, q, scale)):
        whole = run(x)
        assert torch.equal(whole[0], torch.zeros(40)) and torch.equal(whole[6], torch.zeros(40))
        for i in (1, 5, 8, 10):  # each row alone gets the same bits as in the batch
            assert torch.equal(whole[i], run(x[i : i + 1])[0])
    assert torch.equal(q4_i8(torch.zeros(0, 576), g), torch.zeros(0, 40))


@needs_kernels
def test_one_huge_outlier_per_row():
    # The outlier takes the whole int8 range; most other entries quantise to zero. The
    # kernels still compute exactly the quantised product.
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(9, 576, generator=gen)
    x[torch.arange(9), torch.randint(0, 576, (9,), generator=gen)] = torch.tensor(
        [1e4, -1e4, 3e5, -3e5, 1e4, 50.0, -50.0, 1e6, 2e4]
    )
    g = groups(33, 576, seed=6)
    q, scale = int8_per_row(torch.randn(33, 576, generator=gen))
    assert relative_error(q4_i8(x, g), reference(x, g.dequantize().double())) < 1e-6
    assert relative_error(q8_i8(x, q, scale), reference(x, int8_weight(q, scale))) < 1e-6


@needs_kernels
@pytest.mark.parametrize("level", [0, 15])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_q4_i8_extreme_sums(level, sign):
    # All weights 15 and every activation +-127: the largest group sums (32 * 15 * 127; in
    # AVX2's int16 steps 8 * 2 * 15 * 127 = 30480, just inside int16). All weights 0: only
    # the minima count.
    n, k = 17, 96
    g = Int4Groups(
        torch.full((n, k), level, dtype=torch.uint8),
        torch.full((n, k // 32), 0.125),
        torch.full((n, k // 32), -1.0),
    )
    x = torch.full((5, k), sign * 3.0)
    y = q4_i8(x, g)
    expected = sign * 3.0 * k * (level * 0.125 - 1.0)  # a = 3 / 127, xq = +-127
    assert torch.allclose(y.double(), torch.full((5, n), expected, dtype=torch.float64), rtol=1e-6)
    assert relative_error(y, reference(x, g.dequantize().double())) < 1e-6


@needs_kernels
@pytest.mark.parametrize("weight_sign", [1, -1])
@pytest.mark.parametrize("x_sign", [1.0, -1.0])
def test_q8_i8_extreme_sums(weight_sign, x_sign):
    # +-127 x +-127 everywhere: the largest products (VNNI sees 1 or 255 times +-127).
    q = torch.full((17, 1536), 127 * weight_sign, dtype=torch.int8)
    x = torch.full((3, 1536), x_sign * 0.5)
    y = q8_i8(x, q, torch.full((17,), 0.01))
    expected = x_sign * weight_sign * 0.5 * 1.27 * 1536
    assert torch.allclose(y.double(), torch.full((3, 17), expected, dtype=torch.float64), rtol=1e-6)


@needs_kernels
def test_bad_calls_are_one_sentence_errors():
    g = groups(8, 64, seed=0)
    packed = int8.pack_q4_i8(g.q, g.scale, g.minimum)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        int8.q4_i8_gemm(torch.randn(2, 32), packed, 8)
    with pytest.raises(RuntimeError, match="does not fit the 1 blocks"):
        int8.q4_i8_gemm(torch.randn(2, 64), packed, 17)
    q, scale = int8_per_row(torch.randn(4, 24))
    with pytest.raises(RuntimeError, match="x has 20 columns, the packed weight 24"):
        int8.q8_i8_gemm(torch.randn(1, 20), int8.pack_q8_i8(q, scale), 4)


# -- the same bits at every instruction-set level ------------------------------------------------

_CASES = """
import sys, torch
from engine_ref.core import kernels
from engine_ref.core.kernels import int8
from engine_ref.core.quant import Int4Groups, int8_per_row
assert kernels.available(), kernels.unavailable_reason()
out = {"isa": kernels.active_isa()}
gen = torch.Generator().manual_seed(0)
for m, n, k in [(1, 33, 576), (5, 17, 1536), (9, 48, 64), (17, 16, 96)]:
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen) * 4
    x[0, k // 3] = 1e4
    g = Int4Groups.quantize(w)
    out[("q4", m, n, k)] = int8.q4_i8_gemm(x, int8.pack_q4_i8(g.q, g.scale, g.minimum), n)
    kq = k - 3
    q, s = int8_per_row(w[:, :kq])
    out[("q8", m, n, kq)] = int8.q8_i8_gemm(x[:, :kq], int8.pack_q8_i8(q, s), n)
torch.save(out, sys.argv[1])
"""


def _run_cases(path, isa: str | None) -> dict:
    env = dict(os.environ)
    env.pop(kernels.ISA_ENV, None)
    if isa is not None:
        env[kernels.ISA_ENV] = isa
    subprocess.run([sys.executable, "-c", _CASES, str(path)], env=env, check=True,
                   capture_output=True, text=True, timeout=600)  # fmt: skip
    return torch.load(path)


@needs_kernels
@pytest.mark.slow  # builds the AVX2 library once (about 20 s), then loads it from the cache
def test_avx2_gives_the_same_bits_as_this_cpus_best_level(tmp_path):
    best = kernels.best_isa()
    if best is None or best.name == "avx2":
        pytest.skip("this CPU's best level is AVX2: nothing to compare it with")
    low = _run_cases(tmp_path / "avx2.pt", "avx2")
    high = _run_cases(tmp_path / "best.pt", None)
    assert (low.pop("isa"), high.pop("isa")) == ("avx2", best.name)
    assert low.keys() == high.keys()
    for case, y in high.items():
        assert torch.equal(low[case], y), case
