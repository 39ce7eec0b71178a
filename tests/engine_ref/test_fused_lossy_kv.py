"""The fused decoder layer (`refkern::decode_layer`) over lossy KV pools (`--kv-cache-dtype`
fp16, int8, fp8_e4m3): a row stored and read back by hand; the layer over every storage
against a float64 layer reading the pool it wrote, with the head sizes that take the vector
and the scalar tails; the bytes it stores equal to `kv_dtype.store_rows` of the same float32
rows; bad pools refused in one sentence; and through `LLMEngine.step`: the fused path taken
for lossy pools, with the layer-by-layer engine's greedy tokens and logprobs, and the bytes
each fused step writes equal to torch's store of the rows it computed.

Why bytes are compared against the fused layer's own float32 rows, not against the layer-by-
layer engine's pool: the two paths compute K/V with other GEMMs (and a bfloat16 engine's
Python layers round them to bfloat16 first), so their rows differ in the last bits (measured
on tiny-random float32: 718 of 896 layer-0 values differ, by up to 6e-7) and a quantised byte
may differ where a row's value sits at a rounding boundary. What must hold exactly is the
store: the same float32 rows quantised by the C store and by `quantize_rows`."""

from __future__ import annotations

import pytest
import torch
from greedy_util import greedy_tokens_and_logprobs

from engine_ref import EngineConfig, LLMEngine
from engine_ref.core import kernels, kv_dtype
from engine_ref.core.kv_dtype import KVFormat, QuantizedKVPool
from engine_ref.core.model import LlamaModel, rope_tables

needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"engine kernels off: {kernels.unavailable_reason()}"
)
pytestmark = needs_kernels
CPU = torch.device("cpu")
LONG = dict(dtype=torch.long)
STORAGES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp16": torch.float16,
            "bf16": torch.bfloat16, "f32": torch.float32}  # fmt: skip


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _snapshot(pool) -> tuple[torch.Tensor, ...]:
    if isinstance(pool, QuantizedKVPool):
        return (_raw(pool.values).clone(), pool.scales.clone())
    return (pool.clone(),)


def _copy(pool):
    if isinstance(pool, QuantizedKVPool):
        return QuantizedKVPool(pool.values.clone(), pool.scales.clone())
    return pool.clone()


def _dequantised(pool) -> torch.Tensor:
    if isinstance(pool, QuantizedKVPool):
        return pool.values.double() * pool.scales.double().unsqueeze(-1)
    return pool.double()


def _layer(x, weights, cos, sin, pool, slots, tables, lens, heads, eps=1e-5, scale=0.25):
    """One `decode_layer` call over a `kv_dtype` pool (values and scales apart)."""
    values, scales = pool, None
    if isinstance(pool, QuantizedKVPool):
        values, scales = pool.values, pool.scales
    empty = torch.empty(0, **LONG)
    return torch.ops.refkern.decode_layer(
        x, weights, cos, sin, values, slots, tables, lens, empty, empty, heads, eps, scale, scales
    )


# -- one row by hand ---------------------------------------------------------------------------
# A layer of one head of 16 (D 16, eps 0) on a row of ones: the normed row is ones exactly, so
# with qkv weights whose column 0 holds a row the new key and value are exactly that row; RoPE
# is the identity (cos 1, sin 0); the row is its sequence's first, so it attends to itself with
# weight 1; o_proj is the identity and the MLP zero: the output is exactly 1 + the value row
# as the pool gives it back.
# int8 (absmax 254, scale 2): the row / 2 is [127, 2.5, -3.5, 0.5, -0.5, 1.5, -64, 0, ...],
# rounded half to even [127, 2, -4, 0, 0, 2, -64, 0], read back times 2.
# fp8 (absmax 448, scale 1): 448 = 0 1111 110, 3.3 -> 3.25 = 0 1000 101, 2^-9 (the smallest
# subnormal) = 0 0000 001, 17 -> 16 (a tie, to the even mantissa) = 0 1011 000, -0.75 =
# 1 0110 100. fp16 (no scale): 1 + 2^-11 is a tie between 1 and 1 + 2^-10, to 1; 1 + 3 x 2^-11
# a tie, up to 1 + 2^-9; 65504 its largest finite value; -0.1 -> -1638 x 2^-14.
BY_HAND = {
    "int8": (torch.int8,
             [254.0, 5.0, -7.0, 1.0, -1.0, 3.0, -128.0] + [0.0] * 9,
             [127, 2, -4, 0, 0, 2, -64] + [0] * 9, 2.0,
             [254.0, 4.0, -8.0, 0.0, 0.0, 4.0, -128.0] + [0.0] * 9),
    "fp8": (torch.float8_e4m3fn,
            [448.0, -448.0, 1.0, 3.3, 2.0**-9, 17.0, 0.0, -0.75] + [0.0] * 8,
            [0x7E, 0xFE, 0x38, 0x45, 0x01, 0x58, 0x00, 0xB4] + [0] * 8, 1.0,
            [448.0, -448.0, 1.0, 3.25, 2.0**-9, 16.0, 0.0, -0.75] + [0.0] * 8),
    "fp16": (torch.float16,
             [1 + 2.0**-11, 1 + 3 * 2.0**-11, 65504.0, -0.1] + [0.0] * 12,
             None, None,
             [1.0, 1 + 2.0**-9, 65504.0, -1638 * 2.0**-14] + [0.0] * 12),
}  # fmt: skip


@pytest.mark.parametrize("name", BY_HAND)
def test_a_row_is_stored_and_read_back_by_hand(name):
    storage, row, stored, scale, read_back = BY_HAND[name]
    d = 16
    qkv = torch.zeros(3 * d, d)
    qkv[d:, 0] = torch.tensor(row + row)  # key then value: the same row
    eye, zeros, unused, ones = torch.eye(d), torch.zeros(d, d), torch.empty(0), torch.ones(d)
    weights = [ones, qkv, unused, unused, eye, unused, unused, ones,
               torch.zeros(2 * d, d), unused, unused, zeros, unused, unused]  # fmt: skip
    pool = kv_dtype.allocate_pool(KVFormat(storage), (2, 1, 4, d), CPU)
    out = _layer(torch.ones(1, d), weights, torch.ones(1, d), torch.zeros(1, d), pool,
                 torch.tensor([0], **LONG), torch.tensor([[0]], **LONG),
                 torch.tensor([1], **LONG), heads=1, eps=0.0)  # fmt: skip
    values = pool.values if isinstance(pool, QuantizedKVPool) else pool
    if stored is not None:
        for head in (0, 1):  # key, value
            assert _raw(values[head, 0, 0]).tolist() == stored
            assert pool.scales[head, 0].tolist() == [scale, 0.0, 0.0, 0.0]
    else:
        assert values[:, 0, 0].tolist() == [read_back, read_back]
    assert not values[:, 0, 1:].float().any()  # the other slots untouched
    assert out[0].tolist() == [1 + v for v in read_back]


# -- the layer over every storage against float64 ---------------------------------------------
# (heads, kv heads, head_dim): tiny-random's (two 8-lane vectors a row); head_dim 12, one
# vector and a 4-value scalar tail, with a GQA group of 4.
SHAPES = {"tiny-random": (4, 2, 16), "head-12": (4, 1, 12)}
D, INTER, BLOCK = 32, 32, 4
# Rows: decode rows of two sequences (contexts 5 and 17), then a chunk of three rows of a
# third (positions 30, 31, 32), each attending up to its own position.
LENS = [5, 17, 31, 32, 33]
SEQUENCE = [0, 1, 2, 2, 2]


def _case(storage, shape, seed):
    heads, kv_heads, hd = shape
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [2, 5, 9]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for nb in blocks_needed:
        tables.append(order[start : start + nb] + [order[-1]] * (9 - nb))
        start += nb
    table = torch.tensor([tables[s] for s in SEQUENCE], **LONG)
    last = [(tables[s], n - 1) for s, n in zip(SEQUENCE, LENS, strict=True)]
    slots = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for t, p in last], **LONG)
    pool = kv_dtype.allocate_pool(KVFormat(storage), (2 * kv_heads, num_blocks, BLOCK, hd), CPU)
    rows = 2 * kv_heads * num_blocks * BLOCK  # every row random, of varied magnitude
    magnitude = torch.rand(rows, 1, generator=gen) * 3 + 0.1
    kv_dtype.store_rows(pool, torch.arange(rows), torch.randn(rows, hd, generator=gen) * magnitude)
    qkv_n = (heads + 2 * kv_heads) * hd
    unused = torch.empty(0)

    def w(*size, s=0.3):
        return torch.randn(*size, generator=gen) * s

    weights = [1 + w(D, s=0.1), w(qkv_n, D), unused, unused, w(D, heads * hd), unused, unused,
               1 + w(D, s=0.1), w(2 * INTER, D), unused, unused, w(D, INTER), unused,
               unused]  # fmt: skip
    cos, sin = rope_tables(hd, 64, 10000.0)
    positions = torch.tensor(LENS) - 1
    x = torch.randn(len(LENS), D, generator=gen)
    return x, weights, cos[positions].contiguous(), sin[positions].contiguous(), pool, slots, table


def _float64_layer(x, weights, cos, sin, pool_after, table, heads, eps=1e-5, scale=0.25):
    """The layer in float64 (model.py's formulas), attending over the pool as the call left
    it, dequantised; also returns the new rows' keys and values [M, 2 kvh, hd]."""
    w = [t.double() for t in weights]
    x = x.double()
    deq = _dequantised(pool_after)
    kv_heads, hd = deq.shape[0] // 2, deq.shape[3]

    def rms(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    qkv = (rms(x, w[0]) @ w[1].T).view(len(x), -1, hd)
    rotated = qkv * cos.double()[:, None] + qkv.roll(hd // 2, -1) * sin.double()[:, None]
    qkv = torch.cat([rotated[:, : heads + kv_heads], qkv[:, heads + kv_heads :]], dim=1)
    attn = torch.empty(len(x), heads, hd, dtype=torch.float64)
    for m, n in enumerate(LENS):
        slots = [int(table[m, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
        for head in range(heads):
            kh = head // (heads // kv_heads)
            keys = deq[kh].reshape(-1, hd)[slots]
            values = deq[kv_heads + kh].reshape(-1, hd)[slots]
            attn[m, head] = torch.softmax(keys @ qkv[m, head] * scale, dim=0) @ values
    x = x + attn.view(len(x), -1) @ w[4].T
    gate, up = (rms(x, w[7]) @ w[8].T).split(INTER, dim=-1)
    return x + (torch.nn.functional.silu(gate) * up) @ w[11].T, qkv[:, heads:]


def check_fused_layer(storage, shape, seed=0) -> None:
    """`decode_layer` over a pool of `storage`: its stores equal `store_rows` of the float32
    rows the same call computes (taken from a float32 pool, where the store is a copy), and
    its output equals a float64 layer over the pool it left. Called by
    test_kv_cache_dtype.py's run at each instruction-set level too."""
    heads = shape[0]
    x, weights, cos, sin, pool, slots, table = _case(storage, shape, seed)
    scratch = torch.zeros(pool.shape)
    _layer(x, weights, cos, sin, scratch, slots, table, torch.tensor(LENS), heads)
    num_heads, num_blocks = pool.shape[0], pool.shape[1]
    index = (torch.arange(num_heads)[:, None] * num_blocks * BLOCK + slots[None, :]).flatten()
    rows = scratch.view(-1, pool.shape[3])[index]  # [2 kvh * M, hd], head-major
    expected = _copy(pool)
    kv_dtype.store_rows(expected, index, rows)

    out = _layer(x, weights, cos, sin, pool, slots, table, torch.tensor(LENS), heads)

    for got, want in zip(_snapshot(pool), _snapshot(expected), strict=True):
        assert torch.equal(got, want)  # bit for bit, every slot
    reference, new_kv = _float64_layer(x, weights, cos, sin, pool, table, heads)
    torch.testing.assert_close(rows.view(num_heads, len(LENS), -1).transpose(0, 1).double(),
                               new_kv, atol=1e-5, rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("storage", STORAGES.values(), ids=STORAGES.keys())
def test_the_fused_layer_matches_float64_over_the_pool_it_wrote(storage, shape):
    check_fused_layer(storage, shape)


def test_bad_pools_are_refused_in_one_sentence():
    x, weights, cos, sin, pool, slots, table = _case(torch.int8, SHAPES["tiny-random"], 0)
    lens, empty = torch.tensor(LENS), torch.empty(0, **LONG)

    def call(values, scales):
        return torch.ops.refkern.decode_layer(
            x, weights, cos, sin, values, slots, table, lens, empty, empty, 4, 1e-5, 0.25, scales
        )

    with pytest.raises(RuntimeError, match="an int8 or float8 pool needs kv_scales, a contig"):
        call(pool.values, None)
    with pytest.raises(RuntimeError, match="an int8 or float8 pool needs kv_scales"):
        call(pool.values, pool.scales[:, :-1].contiguous())  # one block short
    with pytest.raises(RuntimeError, match="kv_scales go with int8 and float8 pools only"):
        call(pool.values.half(), pool.scales)
    with pytest.raises(RuntimeError, match="kv_pool must be a contiguous float32, bfloat16, "):
        call(pool.values.double(), None)


# -- through LLMEngine.step -------------------------------------------------------------------
# 36 prompt tokens: the prefill step is fused too (at most `fused_max_rows`, 48, rows).
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(1 + 2 * i)] for i in range(6)]


def _engine(tiny_model, kv_cache_dtype, dtype="float32", fused=True) -> LLMEngine:
    config = EngineConfig(model="tiny-random", dtype=dtype, device="cpu", num_blocks=64,
                          num_threads=2, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    engine = LLMEngine(config, loaded=tiny_model)
    assert engine.model.fused_decode is not None
    if not fused:
        engine.model.fused_decode = None  # the layers one by one, decode rows by the kernel
    return engine


def _greedy(engine, max_tokens=8):
    """Each prompt's greedy tokens, and their logprobs in one list, all admitted at once."""
    tokens, logprobs = greedy_tokens_and_logprobs(engine, PROMPTS, max_tokens)
    return tokens, [lp for per_prompt in logprobs for lp in per_prompt]


@pytest.fixture
def fused_calls(monkeypatch):
    """The pools (values, scales) of every `decode_layer` call from now on."""
    calls = []
    layer = torch.ops.refkern.decode_layer

    def counted(*args):
        calls.append((args[4], args[13] if len(args) > 13 else None))
        return layer(*args)

    monkeypatch.setattr(torch.ops.refkern, "decode_layer", counted)
    return calls


# Largest |logprob difference| between the fused and the layer-by-layer engine over the 48
# greedy tokens of a float32 engine, measured: fp16 5.5e-6, int8 1.5e-6, fp8 1.9e-6 (GEMM
# order, and now and then a quantised value rounded the other way from a row that differs in
# its last bit). The bound leaves more than 10x; a layer that reads the rows unscaled, or
# quantises them otherwise, is off by 1e-2 and more.
LOGPROB_TOLERANCE = 1e-4
LOSSY = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp16": torch.float16}


@pytest.mark.parametrize("kv_cache_dtype", LOSSY)
def test_a_lossy_pool_runs_the_fused_layer_with_the_layer_by_layer_tokens(
    tiny_model, kv_cache_dtype, fused_calls
):
    unfused = _greedy(_engine(tiny_model, kv_cache_dtype, fused=False))
    assert fused_calls == []
    tokens, logprobs = _greedy(_engine(tiny_model, kv_cache_dtype))
    layers = tiny_model.config.num_hidden_layers
    assert len(fused_calls) == 8 * layers  # a prefill step, then 7 decode steps
    assert all(pool.dtype == LOSSY[kv_cache_dtype] for pool, _ in fused_calls)
    assert all((scales is not None) == (kv_cache_dtype != "fp16") for _, scales in fused_calls)
    assert tokens == unfused[0] and all(len(t) == 8 for t in tokens)
    diffs = [abs(a - b) for a, b in zip(logprobs, unfused[1], strict=True)]
    assert max(diffs) < LOGPROB_TOLERANCE


def test_a_bfloat16_engine_fuses_over_an_int8_pool_with_the_layer_by_layer_tokens(
    tiny_model, fused_calls
):
    """The benchmark's case (bfloat16 activations, int8 KV). The Python layers round K/V to
    bfloat16 before quantising them and compute in bfloat16, so only the tokens are
    compared."""
    unfused = _greedy(_engine(tiny_model, "int8", dtype="bfloat16", fused=False))
    tokens, _ = _greedy(_engine(tiny_model, "int8", dtype="bfloat16"))
    assert len(fused_calls) == 8 * tiny_model.config.num_hidden_layers
    assert tokens == unfused[0]


def test_a_refused_fusion_runs_no_fused_layer(tiny_model, fused_calls, monkeypatch):
    """Control for the call counts above: with `_can_fuse` refusing, the same engine makes
    no `decode_layer` call."""
    monkeypatch.setattr(LlamaModel, "_can_fuse", lambda *_: False)
    _greedy(_engine(tiny_model, "int8"), max_tokens=2)
    assert fused_calls == []


@pytest.mark.parametrize("kv_cache_dtype", LOSSY)
def test_each_fused_step_stores_what_store_rows_stores(tiny_model, kv_cache_dtype, monkeypatch):
    """Every `decode_layer` call of a prefill and two decode steps: the pool after it equals
    the pool before it with `store_rows` of the float32 rows the call computed (the same call
    over a float32 scratch pool keeps them as they are)."""
    layer = torch.ops.refkern.decode_layer
    checked = []

    def checking(*args):
        args = list(args) + [None] * (14 - len(args))
        values, scales, slots = args[4], args[13], args[5]
        pool = values if scales is None else QuantizedKVPool(values, scales)
        expected = _copy(pool)
        scratch = torch.zeros(values.shape)
        layer(*args[:4], scratch, *args[5:13], None)
        heads, num_blocks, block_size, hd = values.shape
        index = (torch.arange(heads)[:, None] * num_blocks * block_size + slots[None, :]).flatten()
        kv_dtype.store_rows(expected, index, scratch.view(-1, hd)[index])
        out = layer(*args)
        for got, want in zip(_snapshot(pool), _snapshot(expected), strict=True):
            assert torch.equal(got, want)
        checked.append(len(slots))
        return out

    engine = _engine(tiny_model, kv_cache_dtype)
    monkeypatch.setattr(torch.ops.refkern, "decode_layer", checking)
    _greedy(engine, max_tokens=3)
    layers = tiny_model.config.num_hidden_layers
    assert checked == [sum(map(len, PROMPTS))] * layers + [len(PROMPTS)] * 2 * layers
