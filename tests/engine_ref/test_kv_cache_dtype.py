"""`--kv-cache-dtype` (`engine_ref.core.kv_dtype`): rows quantised by hand (int8, fp8) on both
store paths; the decode kernel over int8, fp8, float16 and bfloat16 pools and the prefill
(SDPA) path against a float64 attention over the dequantised pool, at this CPU's level, at the
lowest and best instruction-set levels (with the fused layer's checks of
test_fused_lossy_kv.py), and on the scalar path; and through `LLMEngine.step`:
every KV dtype generating, the agreement of each with a float32 pool, the decode kernel reading
the pool in place, the pool bytes by the engine's own gauge and the blocks a memory budget
buys, copy-on-write and speculative moves carrying the scales, prefix-cache keys bound to the
KV dtype, and the one-sentence refusal of an unknown dtype."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from greedy_util import greedy_tokens_and_logprobs
from torch.profiler import ProfilerActivity, profile

from engine_ref import EngineConfig, EngineConfigError, LLMEngine, SamplingParams
from engine_ref.core import kernels, kv_dtype
from engine_ref.core.attention import build_attention_metadata, paged_attention
from engine_ref.core.kernels import attention_ops
from engine_ref.core.kv_dtype import KVFormat, QuantizedKVPool
from engine_ref.serving.cli_serve import serve
from engine_ref.serving.engine_loop import describe_engine
from engine_ref.serving.metrics import ServerMetrics

needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"engine kernels off: {kernels.unavailable_reason()}"
)
CPU = torch.device("cpu")
STORAGES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp16": torch.float16,
            "bf16": torch.bfloat16}  # fmt: skip


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# -- one row quantised by hand ---------------------------------------------------------------
# int8: scale = absmax / 127, values rounded half to even; a zero row has scale 0.
INT8_ROWS = [[127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -64.0, 0.0], [0.0] * 8]
INT8_VALUES = [[127, 2, -4, 0, 0, 2, -64, 0], [0] * 8]
INT8_SCALES = [1.0, 0.0]
# fp8 e4m3: scale = absmax / 448. Row 0 (scale 1): 448 = 0 1111 110, 1 = 0 0111 000,
# 3.3 -> 3.25 = 0 1000 101, 2^-9 (the smallest subnormal) = 0 0000 001, 17 -> 16 (a tie, to
# the even mantissa) = 0 1011 000, -0.75 = 1 0110 100. Row 1 (absmax 896, scale 2): 3 / 2 =
# 1.5 = 0 0111 100; -0.01 / 2 = -0.005 = -2.56 x 2^-9 -> -3 x 2^-9 = 1 0000 011.
FP8_ROWS = [[448.0, -448.0, 1.0, 3.3, 2.0**-9, 17.0, 0.0, -0.75],
            [896.0, 3.0, -0.01, 0.0, 0.0, 0.0, 0.0, 0.0]]  # fmt: skip
FP8_BYTES = [[0x7E, 0xFE, 0x38, 0x45, 0x01, 0x58, 0x00, 0xB4],
             [0x7E, 0x3C, 0x83, 0x00, 0x00, 0x00, 0x00, 0x00]]  # fmt: skip
FP8_SCALES = [1.0, 2.0]
FP8_DEQUANTISED = [[448.0, -448.0, 1.0, 3.25, 2.0**-9, 16.0, 0.0, -0.75],
                   [896.0, 3.0, -3 * 2.0**-8, 0.0, 0.0, 0.0, 0.0, 0.0]]  # fmt: skip


def _store_two_rows(rows: list[list[float]], storage: torch.dtype, path: str) -> QuantizedKVPool:
    """A pool of 1 KV head, 1 block of 2 slots, head_dim 8, whose slot 1 gets rows[0] as its
    key and rows[1] as its value, stored by the torch path or the decode kernel."""
    pool = kv_dtype.allocate_pool(KVFormat(storage), (2, 1, 2, 8), CPU)
    kv = torch.tensor(rows).view(1, 2, 8)  # [T=1, 2 * kvh, hd]
    if path == "torch":
        kv_dtype.store_rows(pool, torch.tensor([1, 3]), kv[0])  # head * 2 slots + slot 1
    else:
        q = torch.zeros(1, 1, 8)
        attention_ops.paged_attention_decode(
            q, kv, pool, torch.tensor([1]), torch.tensor([[0]]), torch.tensor([2]), 1.0
        )
    return pool


@pytest.mark.parametrize("path", ["torch", pytest.param("kernel", marks=needs_kernels)])
def test_an_int8_row_by_hand(path):
    pool = _store_two_rows(INT8_ROWS, torch.int8, path)
    assert pool.values[:, 0, 1].tolist() == INT8_VALUES
    assert pool.scales[:, 0, 1].tolist() == INT8_SCALES
    assert not pool.values[:, 0, 0].any() and not pool.scales[:, 0, 0].any()  # slot 0 untouched


def test_an_int8_scale_is_absmax_over_127_in_float32():
    values, scales = kv_dtype.quantize_rows(torch.tensor([[2.54, -1.0, 0.02, 0.0]]), torch.int8)
    assert values.tolist() == [[127, -50, 1, 0]]
    assert scales.item() == pytest.approx(0.02, rel=1e-7)


@pytest.mark.parametrize("path", ["torch", pytest.param("kernel", marks=needs_kernels)])
def test_an_fp8_row_by_hand(path):
    pool = _store_two_rows(FP8_ROWS, torch.float8_e4m3fn, path)
    assert pool.values.view(torch.uint8)[:, 0, 1].tolist() == FP8_BYTES
    assert pool.scales[:, 0, 1].tolist() == FP8_SCALES
    got = kv_dtype.dequantize_rows(pool.values[:, 0, 1], pool.scales[:, 0, 1], torch.float64)
    assert got.tolist() == FP8_DEQUANTISED


def test_a_bad_kv_cache_dtype_is_one_sentence():
    message = "Unknown kv_cache_dtype 'int4'; use one of auto, bf16, fp16, int8, fp8_e4m3."
    with pytest.raises(EngineConfigError) as caught:
        EngineConfig(kv_cache_dtype="int4")
    assert str(caught.value) == message
    result = CliRunner().invoke(serve, ["--model", "tiny-random", "--kv-cache-dtype", "int4"])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


# -- the decode kernel and the prefill path against float64 ----------------------------------
def _pool(storage, kv_heads, num_blocks, block_size, head_dim, gen):
    """A pool whose every row holds random values of varied magnitude, stored through
    `store_rows` (so int8 and fp8 rows carry their scales)."""
    pool = kv_dtype.allocate_pool(KVFormat(storage), (2 * kv_heads, num_blocks, block_size,
                                                      head_dim), CPU)  # fmt: skip
    rows = 2 * kv_heads * num_blocks * block_size
    magnitude = torch.rand(rows, 1, generator=gen) * 4 + 0.1
    kv_dtype.store_rows(
        pool, torch.arange(rows), torch.randn(rows, head_dim, generator=gen) * magnitude
    )
    return pool


def _dequantised(pool) -> torch.Tensor:
    """The pool in float64, decoded by torch (the test's own reading of the formats)."""
    if isinstance(pool, QuantizedKVPool):
        return pool.values.double() * pool.scales.double().unsqueeze(-1)
    return pool.double()


def _snapshot(pool) -> tuple[torch.Tensor, ...]:
    if isinstance(pool, QuantizedKVPool):
        return (_raw(pool.values).clone(), pool.scales.clone())
    return (pool.clone(),)


def _attend(q, keys, values, scale) -> torch.Tensor:
    """float64 softmax attention of one query row over [L, hd] keys and values."""
    return torch.softmax(keys @ q.double() * scale, dim=0) @ values


def _decode_case(lens, heads, kv_heads, head_dim, storage, q_dtype, seed=0, block_size=16):
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for nb in needed:
        tables.append(order[start : start + nb] + [order[-1]] * (max(needed) - nb))
        start += nb
    pool = _pool(storage, kv_heads, num_blocks, block_size, head_dim, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(q_dtype)
    kv = (torch.randn(len(lens), 2 * kv_heads, head_dim, generator=gen) * 3).to(q_dtype)
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for t, n in zip(tables, lens, strict=True)]  # fmt: skip
    return q, kv, pool, torch.tensor(slots), torch.tensor(tables), torch.tensor(lens)


def _expected_store(pool_before, kv, slots) -> tuple[torch.Tensor, ...]:
    """The pool after storing kv's rows at `slots` through the torch path."""
    if isinstance(pool_before, QuantizedKVPool):
        expected = QuantizedKVPool(pool_before.values.clone(), pool_before.scales.clone())
    else:
        expected = pool_before.clone()
    heads, num_blocks, block_size = pool_before.shape[:3]
    index = (torch.arange(heads)[:, None] * num_blocks * block_size + slots[None, :]).flatten()
    kv_dtype.store_rows(expected, index, kv.transpose(0, 1).reshape(-1, kv.shape[-1]))
    return _snapshot(expected)


def _decode_reference(q, pool, tables, lens, scale) -> torch.Tensor:
    deq = _dequantised(pool)
    kv_heads, block_size = deq.shape[0] // 2, deq.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for t, (table, n) in enumerate(zip(tables.tolist(), lens.tolist(), strict=True)):
        blocks = [table[p // block_size] for p in range(n)]
        offsets = [p % block_size for p in range(n)]
        for head in range(q.shape[1]):
            kh = head // group
            keys, values = deq[kh, blocks, offsets], deq[kv_heads + kh, blocks, offsets]
            out[t, head] = _attend(q[t, head], keys, values, scale)
    return out


# float32 queries: the kernel's float32 sums against float64; bfloat16 ones: outputs rounded
# to bfloat16 (8 bits), against values of magnitude up to ~10.
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=5e-5), torch.bfloat16: dict(atol=4e-2, rtol=2e-2)}
MIXED = [1, 15, 16, 17, 200, 33, 64, 5]
# (heads, kv heads, head_dim): SmolLM2's; tiny-random's; head_dim 24 and 8, which take the
# scalar path at AVX-512's 16 lanes (24 the vector path at AVX2's 8).
SHAPES = {"smollm2": (9, 3, 64), "tiny-random": (4, 2, 16), "head-24": (10, 1, 24),
          "head-8": (6, 3, 8)}  # fmt: skip


def _check_decode(storage, q_dtype, shape, seed=0) -> None:
    heads, kv_heads, head_dim = shape
    q, kv, pool, slots, tables, lens = _decode_case(MIXED, heads, kv_heads, head_dim, storage,
                                                    q_dtype, seed)  # fmt: skip
    expected_pool = _expected_store(pool, kv, slots)
    scale = 1 / math.sqrt(head_dim)
    out = attention_ops.paged_attention_decode(q, kv, pool, slots, tables, lens, scale)
    for got, want in zip(_snapshot(pool), expected_pool, strict=True):
        assert torch.equal(got, want)  # the kernel stores what the torch path stores
    assert out.dtype == q_dtype and out.shape == q.shape
    ref = _decode_reference(q, pool, tables, lens, scale)
    torch.testing.assert_close(out.double(), ref, **TOLERANCE[q_dtype])


@needs_kernels
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("storage", STORAGES.values(), ids=STORAGES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_the_decode_kernel_matches_float64_over_the_dequantised_pool(shape, storage, q_dtype):
    _check_decode(storage, q_dtype, shape)


def _check_prefill(storage, q_dtype, decode_kernel: bool) -> None:
    """A batch of 2 decode rows and 2 prefill chunks (one continuing 20 cached positions)
    through `paged_attention`; the reference reads the pool after the call (dequantised) and
    the new rows' bytes are checked against `store_rows` separately."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, bs, num_blocks = 4, 2, 16, 4, 40
    pool = _pool(storage, kv_heads, num_blocks, bs, head_dim, gen)
    starts, news = [9, 30, 20, 0], [1, 1, 7, 5]
    tables = [[2, 7, 11], list(range(12, 20)), [20, 21, 22, 23, 24, 25, 26], [30, 31]]
    total = sum(news)
    q = torch.randn(total, heads, head_dim, generator=gen).to(q_dtype)
    kv = (torch.randn(total, 2 * kv_heads, head_dim, generator=gen) * 2).to(q_dtype)
    meta = build_attention_metadata(
        start_positions=starts, num_new_tokens=news, block_tables=tables, block_size=bs,
        num_queries_per_kv=heads // kv_heads, num_kv_heads=kv_heads, num_pool_blocks=num_blocks,
        device=CPU, dtype=q_dtype, decode_kernel=decode_kernel,
    )  # fmt: skip
    expected_pool = _expected_store(pool, kv, meta.slot_mapping)
    out = paged_attention(q, kv, pool, meta, scale=0.25)
    for got, want in zip(_snapshot(pool), expected_pool, strict=True):
        assert torch.equal(got, want)
    deq = _dequantised(pool)
    row = 0
    for start, n, table in zip(starts, news, tables, strict=True):
        for pos in range(start, start + n):
            blocks = [table[p // bs] for p in range(pos + 1)]
            offsets = [p % bs for p in range(pos + 1)]
            for head in range(heads):
                kh = head // (heads // kv_heads)
                keys, values = deq[kh, blocks, offsets], deq[kv_heads + kh, blocks, offsets]
                want = _attend(q[row, head], keys, values, 0.25)
                torch.testing.assert_close(out[row, head].double(), want, **TOLERANCE[q_dtype])
            row += 1


@pytest.mark.parametrize("decode_kernel", [False, pytest.param(True, marks=needs_kernels)],
                         ids=["torch-decode", "kernel-decode"])  # fmt: skip
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("storage", STORAGES.values(), ids=STORAGES.keys())
def test_prefill_and_torch_decode_match_float64_over_the_dequantised_pool(
    storage, q_dtype, decode_kernel
):
    _check_prefill(storage, q_dtype, decode_kernel)


@needs_kernels
def test_an_unscaled_int8_pool_is_refused_in_one_sentence():
    q, kv, pool, slots, tables, lens = _decode_case([5], 4, 2, 16, torch.int8, torch.float32)
    with pytest.raises(RuntimeError, match="an int8 or float8 pool needs kv_scales"):
        torch.ops.refkern.paged_attention_decode(q, kv, pool.values, slots, tables, lens, 0.25)
    with pytest.raises(RuntimeError, match="kv_scales go with int8 and float8 pools only"):
        torch.ops.refkern.paged_attention_decode(
            q, kv, pool.values.half(), slots, tables, lens, 0.25, pool.scales
        )


# The same checks, and the fused layer's (test_fused_lossy_kv.py), in a process of their own
# at the lowest and the best instruction-set level
# (their libraries are the ones tests/engine_ref/test_isa_dispatch.py builds; a level between
# costs CI a build of its own, about a minute: run it with BENCH_REF_ISA and this script).
LEVEL_RUN = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
import test_fused_lossy_kv as f
import test_kv_cache_dtype as t
from engine_ref.core import kernels
assert kernels.available(), kernels.unavailable_reason()
for storage in t.STORAGES.values():
    for q_dtype in (torch.float32, torch.bfloat16):
        for shape in t.SHAPES.values():
            t._check_decode(storage, q_dtype, shape, seed=1)
        t._check_prefill(storage, q_dtype, decode_kernel=True)
for storage in f.STORAGES.values():
    for shape in f.SHAPES.values():
        f.check_fused_layer(storage, shape, seed=1)
print(kernels.active_isa())
"""


def _levels() -> list[str]:
    best = kernels.best_isa()
    if best is None or kernels.missing_prerequisite() is not None:
        return []
    return sorted({kernels.ISA_NAMES[0], best.name}, key=kernels.ISA_NAMES.index)


@pytest.mark.slow  # a process per level (each library built once, then loaded from the cache)
@pytest.mark.parametrize("level", _levels())
def test_every_format_at_the_lowest_and_best_instruction_set_levels(level):
    env = {k: v for k, v in os.environ.items() if k != kernels.ISA_ENV}
    env[kernels.ISA_ENV] = level
    here = os.path.dirname(__file__)
    result = subprocess.run([sys.executable, "-c", LEVEL_RUN, here], env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == level


# -- through LLMEngine.step ------------------------------------------------------------------
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(1 + i % 20)] for i in range(12)]


def _engine(tiny_model, kv_cache_dtype: str, dtype: str = "float32", **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype=dtype, device="cpu", num_blocks=64,
                   num_threads=2, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    options.update(overrides)
    return LLMEngine(EngineConfig(**options), loaded=tiny_model)


def _greedy(engine: LLMEngine, prompts=PROMPTS, max_tokens: int = 10):
    """Each prompt's greedy tokens and their logprobs."""
    return greedy_tokens_and_logprobs(engine, prompts, max_tokens)


@pytest.fixture(scope="module")
def float32_pool(tiny_model):
    return _greedy(_engine(tiny_model, "auto"))


# Mean |logprob difference| from a float32 pool over the 120 greedy tokens, measured here:
# fp16 2.4e-5, bf16 1.0e-4, int8 4.7e-4, fp8 5.2e-3. The bounds leave about 4x.
MEAN_LOGPROB_BOUND = {"bf16": 4e-4, "fp16": 1e-4, "int8": 2e-3, "fp8_e4m3": 2e-2}


@pytest.mark.parametrize("kv_cache_dtype", MEAN_LOGPROB_BOUND)
def test_each_kv_dtype_generates_and_agrees_with_a_float32_pool(
    tiny_model, float32_pool, kv_cache_dtype
):
    tokens, logprobs = _greedy(_engine(tiny_model, kv_cache_dtype))
    assert tokens == float32_pool[0] and all(len(t) == 10 for t in tokens)
    diffs = [abs(a - b) for x, y in zip(logprobs, float32_pool[1], strict=True)
             for a, b in zip(x, y, strict=True)]  # fmt: skip
    mean = sum(diffs) / len(diffs)
    assert 0 < mean < MEAN_LOGPROB_BOUND[kv_cache_dtype]  # lossy, within its bound


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "int8", "fp8_e4m3"])
def test_a_bfloat16_engine_generates_with_each_kv_dtype(tiny_model, kv_cache_dtype):
    auto = _greedy(_engine(tiny_model, "auto", dtype="bfloat16"), PROMPTS[:4])
    tokens, logprobs = _greedy(_engine(tiny_model, kv_cache_dtype, dtype="bfloat16"), PROMPTS[:4])
    assert tokens == auto[0]
    if kv_cache_dtype == "bf16":  # the engine's own dtype: the same pool as auto
        assert logprobs == auto[1]


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp16"])
def test_a_decode_step_reads_the_pool_in_place(tiny_model, kv_cache_dtype, monkeypatch):
    """With the layers one by one (the fused layer, which reads the pool in place too, off:
    test_fused_lossy_kv.py), decode rows run the kernel once a layer: no block of the pool is
    gathered (and widened), and no batched matmul of the torch path runs."""
    engine = _engine(tiny_model, kv_cache_dtype)
    engine.model.fused_decode = None
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), ids, params)
    gathers = []
    gather = kv_dtype.gather_blocks
    monkeypatch.setattr(kv_dtype, "gather_blocks", lambda *a: gathers.append(1) or gather(*a))
    engine.step()  # the prefills, which gather their blocks
    layers = engine.model_config.num_hidden_layers
    assert len(gathers) == layers
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert len(engine.step()) == 4
    names = [event.name for event in prof.events()]
    assert names.count("refkern::paged_attention_decode") == layers
    assert "aten::bmm" not in names and len(gathers) == layers


def _gauge(engine: LLMEngine) -> float:
    text = ServerMetrics("m", engine.stats).render().decode()
    line = next(x for x in text.splitlines() if x.startswith("vllm:kv_cache_pool_bytes{"))
    return float(line.split()[-1])


def test_the_pool_bytes_gauge_counts_values_and_scales(tiny_model):
    """tiny-random: 4 layers x 2 KV heads x K and V = 16 rows of head_dim 16 a token; 64 blocks
    of 16 tokens. float32 16 x 64 B = 1,024 B a token; bfloat16 512; int8 16 x 16 values + 16 x 4
    scale bytes = 320 (half of bfloat16's 512 is 256, plus 64)."""
    tokens = 64 * 16
    expected = {"auto": 1024 * tokens, "bf16": 512 * tokens, "fp16": 512 * tokens,
                "int8": 320 * tokens, "fp8_e4m3": 320 * tokens}  # fmt: skip
    for kv_cache_dtype, pool_bytes in expected.items():
        engine = _engine(tiny_model, kv_cache_dtype)
        assert _gauge(engine) == pool_bytes == engine.model_runner.kv_pool_bytes
    assert expected["int8"] == expected["bf16"] // 2 + 16 * 4 * tokens


def test_a_memory_budget_buys_more_blocks_of_int8(tiny_model):
    """1 MiB: bfloat16 blocks of 16 x 512 B -> 128 of them; int8 blocks of 16 x 320 B -> 204."""
    budget = dict(num_blocks=None, kv_cache_memory_bytes=1 << 20)
    blocks = {kv: _engine(tiny_model, kv, **budget).stats().num_blocks_total
              for kv in ("bf16", "int8", "fp8_e4m3")}  # fmt: skip
    assert blocks == {"bf16": 128, "int8": 204, "fp8_e4m3": 204}


def _filled(engine: LLMEngine, seed: int = 0) -> None:
    """Random rows (with scales) in every slot of every layer's pool."""
    gen = torch.Generator().manual_seed(seed)
    for pool in engine.model_runner.kv_caches:
        rows = pool.shape[0] * pool.shape[1] * pool.shape[2]
        kv_dtype.store_rows(
            pool, torch.arange(rows), torch.randn(rows, pool.shape[3], generator=gen)
        )


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "bf16"])
def test_copy_on_write_and_accepted_tree_paths_move_scales_with_values(tiny_model, kv_cache_dtype):
    engine = _engine(tiny_model, kv_cache_dtype, block_size=4)
    _filled(engine)
    runner = engine.model_runner
    before = [_dequantised(pool).clone() for pool in runner.kv_caches]
    runner.copy_blocks([(3, 9), (5, 6)])  # copy-on-write: blocks 3 -> 9 and 5 -> 6
    # A tree's accepted path [2, 3] after position 2: node i's KV was written at position
    # 3 + i, accepted token j's belongs at 3 + j, so positions 5 and 6 move to 3 and 4; with
    # blocks [7, 8] of 4 slots, (block 8, offset 1) -> (7, 3) and (8, 2) -> (8, 0).
    runner.move_accepted_kv(SimpleNamespace(block_table=[7, 8]), 2, [2, 3])
    for pool, old in zip(runner.kv_caches, before, strict=True):
        expected = old.clone()
        expected[:, 9], expected[:, 6] = old[:, 3], old[:, 5]
        expected[:, 7, 3], expected[:, 8, 0] = old[:, 8, 1], old[:, 8, 2]
        assert torch.equal(_dequantised(pool), expected)
        assert not torch.equal(expected, old)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_speculative_token_trees_over_a_quantised_pool_equal_plain_decoding(
    tiny_model, kv_cache_dtype, monkeypatch
):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
            "prompt_lookup_min": 1, "disable_by_batch_size": None, "num_tree_branches": 3}  # fmt: skip
    prompt = tiny_model.tokenizer.encode("a b c a b d a b e a b c a b d a b e a b")
    params = SamplingParams(max_tokens=40, temperature=1.5, seed=4, ignore_eos=True)

    def run(engine: LLMEngine) -> list[int]:
        engine.add_request("0", prompt, params)
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.outputs[0].new_token_ids
        return tokens

    engine = _engine(tiny_model, kv_cache_dtype, num_blocks=256, speculative_config=spec)
    moved = []
    original = engine.model_runner.move_accepted_kv
    monkeypatch.setattr(engine.model_runner, "move_accepted_kv",
                        lambda seq, start, path: (moved.append(path), original(seq, start, path)))  # fmt: skip
    assert run(engine) == run(_engine(tiny_model, kv_cache_dtype, num_blocks=256))
    assert any(path != list(range(len(path))) for path in moved)


# -- prefix-cache keys -----------------------------------------------------------------------
def _block_keys(engine: LLMEngine, prompt: list[int]) -> list[int]:
    """The cache keys of the prompt's full blocks once it has run."""
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    return sorted(engine.block_manager.key_to_block)


def test_prefix_cache_keys_bind_the_kv_dtype(tiny_model):
    """The same prompt's blocks get other keys (and the root key differs) under another
    storage; the same storage gives the same keys in another engine. On a bfloat16 engine
    `bf16` is `auto`'s pool, so they share keys; on a float32 engine they do not."""
    prompt = list(range(100, 140))  # 2 full blocks of 16, the last token's block not
    keys = {}
    roots = {}
    for dtype, kv in [("float32", "auto"), ("float32", "bf16"), ("float32", "int8"),
                      ("float32", "fp8_e4m3"), ("bfloat16", "auto"), ("bfloat16", "bf16"),
                      ("bfloat16", "int8")]:  # fmt: skip
        engine = _engine(tiny_model, kv, dtype=dtype)
        keys[dtype, kv] = _block_keys(engine, prompt)
        roots[dtype, kv] = engine.block_manager.root_key
        assert len(keys[dtype, kv]) == 2
    assert keys["bfloat16", "auto"] == keys["bfloat16", "bf16"]
    assert _block_keys(_engine(tiny_model, "int8"), prompt) == keys["float32", "int8"]
    distinct = [k for k in keys if k != ("bfloat16", "bf16")]
    for i, a in enumerate(distinct):
        for b in distinct[i + 1 :]:
            assert not set(keys[a]) & set(keys[b]), (a, b)
            assert roots[a] != roots[b], (a, b)


def test_an_int8_request_never_hits_blocks_cached_under_bf16(tiny_model):
    """The bf16 engine's cached blocks handed to an int8 engine of the same model, dtype and
    salt (as a cache shared between them would): the same prompt finds none of them."""
    prompt = list(range(100, 140))
    bf16 = _engine(tiny_model, "bf16")
    _block_keys(bf16, prompt)
    int8 = _engine(tiny_model, "int8")
    for name in ("key_to_block", "block_key", "block_tokens", "block_parent"):
        setattr(int8.block_manager, name, copy.copy(getattr(bf16.block_manager, name)))
    int8.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0))
    int8.step()
    stats = int8.stats()
    assert stats.prefix_cache_query_tokens == 40 and stats.prefix_cache_hit_tokens == 0
    # Control: the bf16 engine itself serves 32 of the same prompt's tokens from its cache.
    bf16.add_request("q", prompt, SamplingParams(max_tokens=1, temperature=0))
    bf16.step()
    assert bf16.stats().prefix_cache_hit_tokens == 32


def test_the_engine_config_reports_the_kv_dtype(tiny_model):
    engine = _engine(tiny_model, "fp8_e4m3")
    assert describe_engine(engine)["engine_config"]["kv_cache_dtype"] == "fp8_e4m3"
    assert json.dumps(describe_engine(engine))  # serialisable, as the manifest writes it
