"""`refkern::paged_attention_decode` (kernels/paged_attention.cpp): decode rows against a float64
reference read straight from the block tables (context lengths around the block size, long
contexts, rows of different lengths, shuffled tables, float32 and bfloat16, GQA groups up to
and past the kernel's 8 heads, head sizes off the vector width), its one-sentence errors, the
metadata that selects it, and through `LLMEngine.step`: the same greedy tokens as the torch
path, and the op running in a step above the fused layer's row bound (not at it, not when
switched off)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from greedy_util import greedy_tokens, greedy_tokens_and_logprobs
from torch.profiler import ProfilerActivity, profile

from engine_ref import EngineConfig, LLMEngine, SamplingParams, build_engine
from engine_ref.core import attention, kernels, model_runner
from engine_ref.core.attention import build_attention_metadata, paged_attention
from engine_ref.core.kernels import attention_ops

needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"engine kernels off: {kernels.unavailable_reason()}"
)
POISON = 30.0  # in every pool position no row may read: a read of one moves the output


def _case(lens, heads, kv_heads, head_dim, dtype, *, block_size=16, seed=0):
    """q, kv, pool, slots, padded tables, context lengths: each row's blocks drawn from a
    shuffled pool; positions past a row's context and the padding block hold POISON."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    pad_block, order = order[0], order[1:]
    pool = torch.randn(2 * kv_heads, num_blocks, block_size, head_dim, generator=gen)
    pool[:, pad_block] = POISON
    tables, start = [], 0
    for n, nb in zip(lens, needed, strict=True):
        table = order[start : start + nb]
        start += nb
        last, used = table[-1], n - (nb - 1) * block_size
        pool[:, last, used:] = POISON  # the rest of the row's last block
        tables.append(table + [pad_block] * (max(needed) - nb))
    rows = len(lens)
    q = torch.randn(rows, heads, head_dim, generator=gen)
    kv = torch.randn(rows, 2 * kv_heads, head_dim, generator=gen)
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for t, n in zip(tables, lens, strict=True)]  # fmt: skip
    return (q.to(dtype), kv.to(dtype), pool.to(dtype), torch.tensor(slots), torch.tensor(tables),
            torch.tensor(lens))  # fmt: skip


def _reference(q, kv, pool, slots, tables, lens, scale):
    """float64 attention of each row over its context, read position by position through its
    block table; the pool after the new rows are stored (when kv is given)."""
    pool = pool.double().clone()
    kv_heads, block_size = pool.shape[0] // 2, pool.shape[2]
    if kv is not None:
        for t, slot in enumerate(slots.tolist()):
            pool[:, slot // block_size, slot % block_size] = kv[t].double()
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // kv_heads
    for t, (table, n) in enumerate(zip(tables.tolist(), lens.tolist(), strict=True)):
        blocks = [table[p // block_size] for p in range(n)]
        offsets = [p % block_size for p in range(n)]
        keys, values = pool[:kv_heads, blocks, offsets], pool[kv_heads:, blocks, offsets]
        for head in range(q.shape[1]):
            kh = head // group
            weights = torch.softmax(keys[kh] @ q[t, head].double() * scale, dim=0)
            out[t, head] = weights @ values[kh]
    return out, pool


TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=2e-5), torch.bfloat16: dict(atol=1e-3, rtol=8e-3)}
LENGTHS = {
    "one": [1],
    "block-1": [15],
    "block": [16],
    "block+1": [17],
    "long": [1000, 777],
    "mixed": [1, 15, 16, 17, 200, 33, 64, 5],
}


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _check(lens, heads, kv_heads, head_dim, dtype, store, seed=0):
    q, kv, pool, slots, tables, lens_t = _case(lens, heads, kv_heads, head_dim, dtype, seed=seed)
    scale = 1 / math.sqrt(head_dim)
    new = kv if store else None
    ref, ref_pool = _reference(q, new, pool, slots, tables, lens_t, scale)
    out = attention_ops.paged_attention_decode(q, new, pool, slots, tables, lens_t, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, **TOLERANCE[dtype])
    assert torch.equal(pool, ref_pool.to(dtype))  # stored exactly; nothing else written


@needs_kernels
@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_smollm2_heads_match_a_float64_reference(lengths, dtype, store, threads):
    threads(2)
    _check(lengths, 9, 3, 64, dtype, store)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 2, 16), (8, 8, 32), (10, 1, 24), (18, 2, 64), (6, 3, 8)],
    ids=["tiny-random", "no-gqa", "group-10-head-24", "group-9", "head-8"],
)
def test_other_head_shapes_match_a_float64_reference(heads, kv_heads, head_dim, dtype, threads):
    threads(2)
    _check(LENGTHS["mixed"], heads, kv_heads, head_dim, dtype, store=True)


@needs_kernels
@pytest.mark.parametrize("num_threads", [1, 3])
@pytest.mark.parametrize("rows", [kernels.DENSE_SMALL_BATCH_ROWS + 1, 64])
def test_many_rows_of_random_lengths_split_over_threads(rows, num_threads, threads):
    threads(num_threads)
    lens = torch.randint(1, 300, (rows,), generator=torch.Generator().manual_seed(rows)).tolist()
    _check(lens, 9, 3, 64, torch.float32, store=True, seed=rows)


@needs_kernels
def test_bad_input_is_one_sentence():
    q, kv, pool, slots, tables, lens = _case([5, 20], 4, 2, 16, torch.float32)
    call = functools.partial(attention_ops.paged_attention_decode, scale=0.25)
    with pytest.raises(RuntimeError, match="context length 33 is outside its block table"):
        call(q, kv, pool, slots, tables, torch.tensor([5, 33]))
    with pytest.raises(RuntimeError, match="context length 0"):
        call(q, kv, pool, slots, tables, torch.tensor([0, 20]))
    with pytest.raises(RuntimeError, match="names block 99, outside the pool"):
        call(q, kv, pool, slots, torch.tensor([[99, 0], [1, 2]]), lens)
    with pytest.raises(RuntimeError, match="in the pool's dtype"):
        call(q.bfloat16(), kv, pool, slots, tables, lens)
    with pytest.raises(RuntimeError, match="must be a multiple of the pool's kv heads"):
        call(q[:, :3], kv, pool, slots, tables, lens)
    with pytest.raises(RuntimeError, match="slot 9999 is outside the pool"):
        call(q, kv, pool, torch.tensor([0, 9999]), tables, lens)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        call(q.half(), kv.half(), pool.half(), slots, tables, lens)
    with pytest.raises(RuntimeError, match="scale must be positive"):
        attention_ops.paged_attention_decode(q, kv, pool, slots, tables, lens, scale=-1.0)


# -- the metadata that selects it, and paged_attention over it ------------------------------


def _meta(decode_kernel, starts, news, tables, **kw):
    return build_attention_metadata(
        start_positions=starts, num_new_tokens=news, block_tables=tables, block_size=4,
        num_queries_per_kv=2, num_kv_heads=1, num_pool_blocks=12, device=torch.device("cpu"),
        decode_kernel=decode_kernel, **kw,
    )  # fmt: skip


def test_kernel_metadata_is_one_group_of_every_decode_row():
    # Contexts 4 and 40 would be two groups on the torch path.
    meta = _meta(True, [3, 39, 0], [1, 1, 2], [[2], list(range(1, 11)), [5]])
    (group,) = meta.decode_groups
    assert (group.start_row, group.end_row) == (0, 2)
    assert group.kv_rows is None and group.mask is None
    assert group.block_tables.tolist() == [[2] + [0] * 9, list(range(1, 11))]
    assert meta.decode_context_lens.tolist() == [4, 40]
    torch_path = _meta(False, [3, 39, 0], [1, 1, 2], [[2], list(range(1, 11)), [5]])
    assert torch_path.decode_context_lens is None and len(torch_path.decode_groups) == 2
    assert _meta(True, [0], [3], [[1]]).decode_context_lens is None  # no decode rows


def test_the_kernel_is_chosen_on_the_cpu_for_float32_and_bfloat16_only():
    cpu = torch.device("cpu")
    assert not attention_ops.decode_kernel_ok(cpu, torch.float16)
    assert not attention_ops.decode_kernel_ok(torch.device("meta"), torch.float32)
    if kernels.available():
        assert attention_ops.decode_kernel_ok(cpu, torch.bfloat16)
        assert _meta(None, [5], [1], [[1, 2]]).decode_context_lens is not None


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_and_decode_batches_match_the_torch_path(dtype):
    gen = torch.Generator().manual_seed(1)
    h, kvh, hd, bs, nblocks = 6, 2, 16, 4, 30
    pool = torch.randn(2 * kvh, nblocks, bs, hd, generator=gen).to(dtype)
    for starts, news in (([3, 39, 9], [1, 1, 1]), ([3, 39, 0, 6], [1, 1, 5, 7])):
        tables = [[2], list(range(10, 20)), [5, 6, 7], [0, 3, 8, 9]][: len(starts)]
        q = torch.randn(sum(news), h, hd, generator=gen).to(dtype)
        kv = torch.randn(sum(news), 2 * kvh, hd, generator=gen).to(dtype)
        outs, pools = [], []
        for decode_kernel in (True, False):
            meta = build_attention_metadata(
                start_positions=starts, num_new_tokens=news, block_tables=tables, block_size=bs,
                num_queries_per_kv=h // kvh, num_kv_heads=kvh, num_pool_blocks=nblocks,
                device=torch.device("cpu"), dtype=dtype, decode_kernel=decode_kernel,
            )  # fmt: skip
            pools.append(pool.clone())
            outs.append(paged_attention(q, kv, pools[-1], meta, scale=0.25))
        assert torch.equal(pools[0], pools[1])
        # The torch path rounds bfloat16 softmax weights to bfloat16 (the kernel keeps them
        # float32), so the paths differ by more than the kernel's error against float64.
        tolerance = dict(atol=8e-3, rtol=1.6e-2) if dtype == torch.bfloat16 else TOLERANCE[dtype]
        torch.testing.assert_close(outs[0], outs[1], **tolerance)


# -- through LLMEngine.step ------------------------------------------------------------------


def _engine(tiny_model, dtype: str) -> LLMEngine:
    config = EngineConfig(model="tiny-random", dtype=dtype, device="cpu", num_blocks=512,
                          num_threads=2, enable_prefix_caching=False)  # fmt: skip
    return build_engine(config, loaded=tiny_model)


def _prompts(count: int) -> list[list[int]]:
    # Lengths 1..20: contexts cross the 16-token block boundary while decoding.
    return [[(7 * i + 3 * j) % 250 + 1 for j in range(1 + i % 20)] for i in range(count)]


@pytest.fixture
def torch_path(monkeypatch):
    """Call to have every later step's decode rows take the torch path."""
    build = functools.partial(attention.build_attention_metadata, decode_kernel=False)
    return lambda: monkeypatch.setattr(model_runner, "build_attention_metadata", build)


def _decode_step_calls(engine: LLMEngine, rows: int) -> dict[str, int]:
    """Op counts of one decode step of `rows` requests (after their prefill)."""
    for i, ids in enumerate(_prompts(rows)):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=3, temperature=0))
    engine.step()  # every prefill fits one step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outputs = engine.step()
    assert len(outputs) == rows
    counts: dict[str, int] = {}
    for event in prof.events():
        counts[event.name] = counts.get(event.name, 0) + 1
    return counts


@needs_kernels
@pytest.mark.parametrize(
    ("dtype", "rows", "kernel_calls"),
    [
        ("float32", kernels.DENSE_SMALL_BATCH_ROWS, 0),  # the fused layer runs instead
        ("float32", kernels.DENSE_SMALL_BATCH_ROWS + 1, 1),
        ("bfloat16", kernels.DENSE_SMALL_BATCH_ROWS, 0),  # bf16 fuses up to the same bound
        ("bfloat16", kernels.DENSE_SMALL_BATCH_ROWS + 1, 1),
    ],
)
def test_a_decode_step_runs_the_kernel_once_per_layer(tiny_model, dtype, rows, kernel_calls):
    engine = _engine(tiny_model, dtype)
    calls = _decode_step_calls(engine, rows)
    layers = engine.model_config.num_hidden_layers
    assert calls.get("refkern::paged_attention_decode", 0) == kernel_calls * layers
    assert calls.get("aten::bmm", 0) == 0  # no decode row took the torch path
    if not kernel_calls:
        assert calls.get("refkern::decode_layer") == layers


@needs_kernels
def test_switched_off_the_torch_path_runs(tiny_model, torch_path):
    torch_path()
    engine = _engine(tiny_model, "float32")
    calls = _decode_step_calls(engine, kernels.DENSE_SMALL_BATCH_ROWS + 1)
    assert "refkern::paged_attention_decode" not in calls
    assert calls.get("aten::bmm", 0) > 0


@needs_kernels
def test_float32_greedy_tokens_equal_the_torch_paths(tiny_model, torch_path):
    prompts = _prompts(kernels.DENSE_SMALL_BATCH_ROWS + 1)
    with_kernel = greedy_tokens(_engine(tiny_model, "float32"), prompts, 10)
    torch_path()
    assert with_kernel == greedy_tokens(_engine(tiny_model, "float32"), prompts, 10)


def _greedy_logprobs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int):
    """Each prompt's greedy tokens and their logprobs."""
    return list(zip(*greedy_tokens_and_logprobs(engine, prompts, max_tokens), strict=True))


@needs_kernels
def test_bfloat16_greedy_tokens_agree_with_the_torch_paths(tiny_model, torch_path):
    prompts = _prompts(kernels.SMALL_BATCH_ROWS + 8)
    with_kernel = _greedy_logprobs(_engine(tiny_model, "bfloat16"), prompts, 10)
    torch_path()
    without = _greedy_logprobs(_engine(tiny_model, "bfloat16"), prompts, 10)
    # bfloat16 logits can tie differently; a sequence may diverge, not most of them.
    same = [(a, b) for (ta, a), (tb, b) in zip(with_kernel, without, strict=True) if ta == tb]
    assert len(same) >= 0.9 * len(prompts), (len(same), len(prompts))
    # Where the tokens agree, so do their logprobs: 5e-4 apart on average here, 4e-3 when the
    # kernel skips a row's newest position or does not store its K/V.
    diffs = [abs(x - y) for a, b in same for x, y in zip(a, b, strict=True)]
    assert sum(diffs) / len(diffs) < 2e-3
