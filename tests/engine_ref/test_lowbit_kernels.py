"""The engine's own small-batch kernels (`engine_ref.core.kernels`): the int4 layout by hand,
the int4, int8 and float32 GEMMs against float64 references at the row, block and thread
boundaries, a row's result independent of its batch, the switch to torch's kernels above
`SMALL_BATCH_ROWS` (`DENSE_SMALL_BATCH_ROWS` for float32), and the fused decode layer, int4
and float32, through `LLMEngine.step` against the Python layers it replaces."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from greedy_util import greedy_tokens
from torch.profiler import ProfilerActivity, profile

from engine_ref import EngineConfig, LLMEngine, SamplingParams, build_engine
from engine_ref.core import kernels
from engine_ref.core.attention import (
    TREE_BITS_MAX_NODES,
    build_attention_metadata,
    kv_pool_shape,
)
from engine_ref.core.engine_config import SpeculativeConfig
from engine_ref.core.quant import Int4Groups, Int4Linear, Int8Linear, int8_per_row

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"engine kernels off: {kernels.unavailable_reason()}"
)


def test_the_kernels_build_where_a_compiler_is_here():
    """A C++ compiler, ninja and AVX2/FMA/F16C are here, so a failed build of `lowbit.cpp` is a
    failure of this test (with the compiler's first line), not ~200 skips."""
    prerequisite_missing = kernels.missing_prerequisite()
    if prerequisite_missing is not None:
        pytest.skip(f"engine kernels off: {prerequisite_missing}")
    assert kernels.available(), f"engine kernels off: {kernels.unavailable_reason()}"


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def _kernel_calls(fn) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for event in prof.events():
        counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def test_pack_q4_hand_case():
    # q[k] = k % 16 over one 64-weight chunk: lane j holds q[8 t + j] at bits 4 t, so lane 0
    # holds 0, 8, 0, 8, ... (0x80808080) and lane 1 holds 1, 9, 1, 9, ... (0x91919191).
    q = (torch.arange(64) % 16).to(torch.uint8).view(1, 64)
    packed = kernels.pack_q4(q)
    assert packed.shape == (1, 32) and packed.dtype == torch.uint8
    lanes = packed.view(8, 4).to(torch.int64)
    values = [int(sum(int(b) << (8 * i) for i, b in enumerate(lane))) for lane in lanes]
    assert values[0] == 0x80808080 and values[1] == 0x91919191
    assert values[7] == 0xF7F7F7F7  # q[7] = 7, q[15] = 15, ...
    with pytest.raises(ValueError, match="multiple of 64"):
        kernels.pack_q4(torch.zeros(2, 96, dtype=torch.uint8))


def _groups(n: int, k: int, seed: int) -> Int4Groups:
    gen = torch.Generator().manual_seed(seed)
    return Int4Groups.quantize(torch.randn(n, k, generator=gen) * 0.1)


@needs_kernels
@pytest.mark.parametrize("k", [64, 128, 576])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 33])
@pytest.mark.parametrize("m", [1, 7, 8, 9, 16])
def test_q4_gemm_matches_the_dequantized_product(m, n, k):
    groups = _groups(n, k, seed=m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    packed = kernels.pack_q4(groups.q)
    y = kernels.q4_gemm(x, packed, groups.scale.contiguous(), groups.minimum.contiguous())
    ref = x.double() @ groups.dequantize().double().t()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert _relative_error(y, ref) < 1e-5  # float32 accumulation, float32 activations


@needs_kernels
@pytest.mark.parametrize("k", [16, 48, 576])
@pytest.mark.parametrize("n", [1, 17])
@pytest.mark.parametrize("m", [1, 8, 9, 16])
def test_q8_gemm_matches_the_dequantized_product(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    q, scale = int8_per_row(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen)
    y = kernels.q8_gemm(x, q, scale)
    ref = x.double() @ (q.double() * scale.double().unsqueeze(1)).t()
    assert y.shape == (m, n) and _relative_error(y, ref) < 1e-5


@needs_kernels
@pytest.mark.parametrize("k", [16, 48, 576])
@pytest.mark.parametrize("n", [1, 2, 3, 17])
@pytest.mark.parametrize("m", [1, 4, 5, 8, 9, 48])
def test_f32_gemm_matches_a_float64_product(m, n, k):
    # n = 2 and 3: output rows in pairs and the odd one after them (rows of up to 4 share x).
    gen = torch.Generator().manual_seed(m * 100 + n * 10 + k)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    y = kernels.f32_gemm(x, weight)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert _relative_error(y, x.double() @ weight.double().t()) < 1e-6


@needs_kernels
@pytest.mark.parametrize("m", [2, 5, 9, kernels.DENSE_SMALL_BATCH_ROWS])
def test_a_rows_result_does_not_depend_on_its_batch(m):
    # What makes greedy decoding identical with and without speculation: a verify step's
    # rows get bit for bit what one-row decode steps would.
    gen = torch.Generator().manual_seed(m)
    weight, x = torch.randn(33, 576, generator=gen), torch.randn(m, 576, generator=gen)
    groups = _groups(33, 576, seed=m)
    packed = kernels.pack_q4(groups.q)
    whole = kernels.f32_gemm(x, weight)
    whole_q4 = kernels.q4_gemm(x, packed, groups.scale, groups.minimum)
    for i in (0, m // 2, m - 1):
        assert torch.equal(whole[i], kernels.f32_gemm(x[i : i + 1], weight)[0])
        one = kernels.q4_gemm(x[i : i + 1], packed, groups.scale, groups.minimum)
        assert torch.equal(whole_q4[i], one[0])


@needs_kernels
def test_bad_shapes_are_one_sentence_errors():
    groups = _groups(8, 64, seed=0)
    packed = kernels.pack_q4(groups.q)
    with pytest.raises(RuntimeError, match="x has 32 columns, the weight 64"):
        kernels.q4_gemm(torch.randn(2, 32), packed, groups.scale, groups.minimum)
    with pytest.raises(RuntimeError, match=r"scale must be float16 \[N, K/32\]"):
        kernels.q4_gemm(torch.randn(2, 64), packed, groups.scale[:4], groups.minimum)
    q, scale = int8_per_row(torch.randn(4, 24))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.q8_gemm(torch.randn(1, 24), q, scale)
    with pytest.raises(RuntimeError, match="multiple of 16, got 24"):
        kernels.f32_gemm(torch.randn(1, 24), torch.randn(4, 24))
    with pytest.raises(RuntimeError, match=r"weight must be contiguous float32 \[N, K\]"):
        kernels.f32_gemm(torch.randn(1, 32), torch.randn(4, 32, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="x has 16 columns, the weight 32"):
        kernels.f32_gemm(torch.randn(1, 16), torch.randn(4, 32))


@needs_kernels
@pytest.mark.parametrize(
    ("rows", "kernel"),
    [
        (1, "refkern::q4_gemm"),
        (kernels.SMALL_BATCH_ROWS, "refkern::q4_gemm"),
        (kernels.SMALL_BATCH_ROWS + 1, "aten::_weight_int4pack_mm_for_cpu"),
    ],
)
def test_int4_linear_switches_kernel_above_the_small_batch_bound(rows, kernel):
    groups = _groups(48, 128, seed=rows)
    layer = Int4Linear(groups, CPU)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    calls = _kernel_calls(lambda: layer(x))
    assert calls.get(kernel) == 1
    ref = x.double() @ groups.dequantize().double().t()
    # float32 activations in the engine's kernel; bf16 ones in torch's.
    bound = 1e-5 if kernel.startswith("refkern") else 1e-2
    assert _relative_error(layer(x), ref) < bound


@needs_kernels
@pytest.mark.parametrize(
    ("rows", "kernel"),
    [
        (kernels.SMALL_BATCH_ROWS, "refkern::q8_gemm"),
        (kernels.SMALL_BATCH_ROWS + 1, "aten::_weight_int8pack_mm"),
    ],
)
def test_int8_linear_switches_kernel_above_the_small_batch_bound(rows, kernel):
    q, scale = int8_per_row(torch.randn(40, 64, generator=torch.Generator().manual_seed(3)))
    layer = Int8Linear(q, scale)
    x = torch.randn(rows, 64)
    assert _kernel_calls(lambda: layer(x)).get(kernel) == 1


# -- the fused decode layer, through LLMEngine.step ----------------------------------------------


def _engine(**overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=256,
                   num_threads=1, quantization="w4a16", enable_prefix_caching=False)  # fmt: skip
    options.update(overrides)
    return build_engine(EngineConfig(**options))


def _prompts(count: int) -> list[list[int]]:
    # Lengths 14..17 and beyond: contexts cross the 16-token block boundary while decoding,
    # and a 40-token prompt spreads decode rows over two attention groups.
    lengths = [14, 15, 16, 17, 40, 3, 31, 32, 33, 1, 2, 5, 8, 13, 21, 34, 55]
    return [[(7 * i + 3 * j) % 200 + 1 for j in range(lengths[i % len(lengths)])]
            for i in range(count)]  # fmt: skip


def _python_layers(engine: LLMEngine) -> None:
    """Send every later step through the Python layers and torch's head GEMM."""
    engine.model.fused_decode = None
    engine.model.small_head = False


INT4, DENSE = kernels.SMALL_BATCH_ROWS, kernels.DENSE_SMALL_BATCH_ROWS
# (quantization, the most rows its fused forward takes)
KINDS = [("w4a16", INT4), (None, DENSE)]


@needs_kernels
@pytest.mark.parametrize(
    ("quantization", "batch"),
    [(q, b) for q, bound in KINDS for b in (1, bound, bound + 1)],
)
def test_fused_decode_gives_the_python_layers_outputs(quantization, batch):
    engine = _engine(quantization=quantization)
    assert engine.model.fused_decode is not None
    prompts = _prompts(batch)
    fused = greedy_tokens(engine, prompts, 24)
    _python_layers(engine)
    python = greedy_tokens(engine, prompts, 24)
    assert fused == python


@needs_kernels
@pytest.mark.parametrize(
    ("quantization", "batch", "fused_calls"),
    [(q, b, int(b <= bound)) for q, bound in KINDS for b in (bound, bound + 1)],
)
def test_a_decode_step_runs_one_fused_call_per_layer_up_to_the_bound(
    quantization, batch, fused_calls
):
    engine = _engine(quantization=quantization)
    assert engine.model.fused_max_rows == (INT4 if quantization else DENSE)
    for i, ids in enumerate(_prompts(batch)):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # prefill: more rows than the bound, so the Python layers and torch's kernels
    calls = _kernel_calls(engine.step)  # one decode step of every row
    layers = engine.model_config.num_hidden_layers
    assert calls.get("refkern::decode_layer", 0) == fused_calls * layers
    if quantization is None:  # the head: the engine's GEMM up to the bound, torch's above it
        assert calls.get("refkern::f32_gemm", 0) == fused_calls * (4 * layers + 1)
        assert calls.get("aten::mm", 0) + calls.get("aten::addmm", 0) == (1 - fused_calls) * (
            4 * layers + 1
        )
    elif not fused_calls:
        assert calls.get("aten::_weight_int4pack_mm_for_cpu") == 4 * layers


@needs_kernels
@pytest.mark.parametrize(
    ("quantization", "lengths", "fused_calls"),
    [
        ("w4a16", [16], 1),
        ("w4a16", [9, 7], 1),
        ("w4a16", [3, 1, 12], 1),
        ("w4a16", [17], 0),
        ("w4a16", [9, 8], 0),
        (None, [48], 1),
        (None, [30, 1, 17], 1),
        (None, [49], 0),
        (None, [25, 24], 0),
    ],
)
def test_a_prefill_up_to_the_bound_is_fused_and_gives_the_same_tokens(
    quantization, lengths, fused_calls
):
    prompts = [[(5 * i + j) % 300 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    engine = _engine(quantization=quantization)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=6, temperature=0))
    calls = _kernel_calls(engine.step)  # the prefill of every prompt (one step: 2,048 budget)
    assert (
        calls.get("refkern::decode_layer", 0) == fused_calls * engine.model_config.num_hidden_layers
    )
    while engine.has_unfinished():
        engine.step()
    fused = greedy_tokens(engine, prompts, 12)
    _python_layers(engine)
    assert fused == greedy_tokens(engine, prompts, 12)


@needs_kernels
@pytest.mark.parametrize("quantization", ["w4a16", None])
def test_fused_decode_matches_with_speculation_and_sampling(quantization):
    # n-gram verify steps have several rows per sequence; plain decode steps between them too.
    # Seeded sampling must give the same tokens through the fused layer and the Python ones.
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11, 9, 10, 11, 9, 10]]
    runs, verify_rows = [], 0
    for fused in (True, False):
        engine = _engine(
            quantization=quantization,
            speculative_config=SpeculativeConfig(num_speculative_tokens=3),
        )
        if not fused:
            _python_layers(engine)
        params = SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True)
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, params)
        tokens: dict[str, list[int]] = {"0": [], "1": []}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.outputs[0].new_token_ids
        runs.append(tokens)
        verify_rows += engine.stats().spec_decode.num_draft_tokens
    assert verify_rows > 0  # some steps verified drafts
    assert runs[0] == runs[1]


def _chunked_logits(engine: LLMEngine, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position, `ids` fed `chunk` at a time into a scratch pool."""
    mc, bs = engine.model_config, engine.config.block_size
    blocks = -(-len(ids) // bs)
    shape = kv_pool_shape(blocks, bs, mc.num_key_value_heads, mc.head_dim)
    pools = [torch.zeros(shape) for _ in range(mc.num_hidden_layers)]
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            meta = build_attention_metadata(
                start_positions=[start], num_new_tokens=[len(piece)],
                block_tables=[list(range(blocks))], block_size=bs,
                num_queries_per_kv=mc.num_attention_heads // mc.num_key_value_heads,
                num_kv_heads=mc.num_key_value_heads, num_pool_blocks=blocks, device=CPU,
            )  # fmt: skip
            positions = torch.arange(start, start + len(piece))
            hidden = engine.model(torch.tensor(piece), positions, meta, pools)
            out.append(engine.model.compute_logits(hidden))
    return torch.cat(out)


@needs_kernels
@pytest.mark.parametrize("chunk", [1, 7, DENSE])
def test_float32_fused_logits_match_the_python_layers(chunk):
    # The fused layer's own exp (SiLU, softmax) and GEMMs against torch's over 100 positions:
    # softmax lengths of every remainder mod 8 (the exp's tail) and several KV blocks.
    engine = _engine(quantization=None)
    ids = [(13 * j) % 400 + 1 for j in range(100)]
    fused = _chunked_logits(engine, ids, chunk)
    _python_layers(engine)
    python = _chunked_logits(engine, ids, chunk)
    assert fused.shape == (100, engine.model_config.vocab_size)
    assert _relative_error(fused, python.double()) < 1e-5


def test_tree_rows_for_the_fused_layer_by_hand():
    # A decode row at position 4, then a 3-node tree at 10..12: node 1 under node 0, node 2
    # under node 0 too (a sibling of node 1, so it must not see it).
    allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    meta = build_attention_metadata(
        start_positions=[4, 10], num_new_tokens=[1, 3], block_tables=[[0], [1]],
        block_size=16, num_queries_per_kv=1, num_kv_heads=1, num_pool_blocks=2,
        device=CPU, tree_masks={1: allowed},
    )  # fmt: skip
    assert meta.tree_context_lens.tolist() == [5, 11, 12, 13]
    assert meta.tree_start.tolist() == [5, 10, 10, 10]  # the decode row: no window at all
    assert meta.tree_bits.tolist() == [0, 0b001, 0b011, 0b101]


@pytest.mark.parametrize(
    ("nodes", "has_bits"), [(TREE_BITS_MAX_NODES, True), (TREE_BITS_MAX_NODES + 1, False)]
)
def test_trees_past_the_bit_width_are_left_to_the_python_layers(nodes, has_bits):
    chain_of_nodes = torch.ones(nodes, nodes, dtype=torch.bool).tril()
    meta = build_attention_metadata(
        start_positions=[0], num_new_tokens=[nodes], block_tables=[[0, 1, 2, 3, 4]],
        block_size=16, num_queries_per_kv=1, num_kv_heads=1, num_pool_blocks=5,
        device=CPU, tree_masks={0: chain_of_nodes},
    )  # fmt: skip
    assert (meta.tree_bits is not None) == has_bits
    if has_bits:  # the last node sees all 63 before it and itself: 63 bits set
        assert meta.tree_bits[-1].item() == (1 << TREE_BITS_MAX_NODES) - 1


@needs_kernels
@pytest.mark.parametrize("quantization", ["w4a16", None])
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_token_tree_verify_steps_are_fused_and_give_the_python_layers_tokens(
    quantization, temperature
):
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1,
                             num_tree_branches=3, disable_by_batch_size=None)  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=4, ignore_eos=True)
    runs, seen = [], {}
    for fused in (True, False):
        engine = _engine(quantization=quantization, speculative_config=spec)
        if not fused:
            _python_layers(engine)
        prompt = engine.tokenizer.encode("a b c a b d a b e a b c a b d a b e a b")
        can_fuse, seen[fused] = engine.model._can_fuse, []

        def spy(x, meta, kv_caches, can_fuse=can_fuse, log=seen[fused]):
            log.append((meta.has_tree_mask, can_fuse(x, meta, kv_caches)))
            return log[-1][1]

        engine.model._can_fuse = spy
        engine.add_request("t", prompt, params)
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.outputs[0].new_token_ids
        runs.append(tokens)
    assert (True, True) in seen[True]  # some tree verify steps ran the fused layer
    assert not any(fused for _, fused in seen[False])
    assert runs[0] == runs[1] and len(runs[0]) == 40


@needs_kernels
@pytest.mark.slow
@pytest.mark.soak  # a whole cold build (98 s on 2 busy cores): the yield test below is its small case
def test_a_float32_engine_builds_the_kernels_in_the_background(tmp_path):
    # A float32 engine (a server's) must not wait for the first build: it runs torch's
    # kernels and leaves a detached build behind, whose library the next engine loads.
    code = (
        "from engine_ref import EngineConfig, build_engine\n"
        "e = build_engine(EngineConfig(model='tiny-random', dtype='float32', num_blocks=64,"
        " num_threads=1))\n"
        "print(e.model.fused_decode is not None, e.model.small_head)\n"
    )
    # The build lands under BENCH_CACHE_DIR; the user cache dir (XDG) is not touched. At
    # normal priority: at its own (idle) it waits for the other test worker's cores.
    env = dict(os.environ, BENCH_CACHE_DIR=str(tmp_path / "root"), XDG_CACHE_HOME=str(tmp_path),
               **{kernels.BACKGROUND_BUILD_ENV: "normal"})  # fmt: skip

    def engine_line() -> list[str]:
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, timeout=300, check=True)  # fmt: skip
        return result.stdout.split()

    assert engine_line() == ["False", "False"]
    kernel_dirs = tmp_path / "root" / "kernels"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        built = [d for d in kernel_dirs.glob("refkern-*") if any(d.glob("refkern_*.so"))]
        if built and not any((d / "lock").exists() for d in built):
            break
        time.sleep(1)
    assert built, "the background build left no library within 300 s"
    assert not (tmp_path / "llm-bench").exists(), "something was cached beside BENCH_CACHE_DIR"
    assert engine_line() == ["True", "True"]


def _build_processes(cache: Path) -> list[int]:
    """Pids of background builds whose BENCH_CACHE_DIR is `cache`."""
    marker = f"BENCH_CACHE_DIR={cache}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if b"kernels.available()" in (proc / "cmdline").read_bytes() and marker in (
                proc / "environ"
            ).read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return pids


@needs_kernels
@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_the_background_build_yields_the_cores_to_the_engine(tmp_path):
    """The detached build runs SCHED_IDLE at nice 19 in this session (Linux schedules each
    session as a group, so a build in a session of its own took an equal share of the cores
    from the engine whatever its nice value) and in a process group of its own (a Ctrl-C in
    the terminal does not reach it). The build is stopped once seen."""
    cache = tmp_path / "root"
    env = {k: v for k, v in os.environ.items() if k != kernels.BACKGROUND_BUILD_ENV}
    env |= {"BENCH_CACHE_DIR": str(cache), "XDG_CACHE_HOME": str(tmp_path)}
    code = (
        "from engine_ref import EngineConfig, build_engine\n"
        "e = build_engine(EngineConfig(model='tiny-random', dtype='float32', num_blocks=64,"
        " num_threads=1))\n"
        "print(e.model.fused_decode is not None)\n"
    )
    # The engine comes up on torch's kernels without waiting for the build it started.
    result = subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120,
                            capture_output=True, text=True)  # fmt: skip
    assert result.stdout.split() == ["False"]
    deadline = time.monotonic() + 30
    seen = None
    while time.monotonic() < deadline and seen is None:
        for pid in _build_processes(cache):
            with contextlib.suppress(OSError):
                if os.sched_getscheduler(pid) == os.SCHED_IDLE:
                    seen = pid
        time.sleep(0.05)
    try:
        assert seen is not None, "no background build running SCHED_IDLE within 30 s"
        assert os.getpriority(os.PRIO_PROCESS, seen) == 19
        assert os.getsid(seen) == os.getsid(0), "the build left this session"
        assert os.getpgid(seen) == seen, "the build shares a process group a Ctrl-C reaches"
    finally:
        for pid in _build_processes(cache):
            with contextlib.suppress(OSError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)


def test_kernels_off_by_environment_leave_torchs_kernels_running():
    code = (
        "from engine_ref.core import kernels\n"
        "from engine_ref import EngineConfig, SamplingParams, build_engine\n"
        "print(kernels.available(), kernels.unavailable_reason())\n"
        "e = build_engine(EngineConfig(model='tiny-random', dtype='float32', num_blocks=64,"
        " num_threads=1, quantization='w4a16'))\n"
        "e.add_request('a', [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))\n"
        "while e.has_unfinished(): e.step()\n"
        "print(e.model.fused_decode is None, e.model.layers[0].mlp.down_proj.small)\n"
        "d = build_engine(EngineConfig(model='tiny-random', dtype='float32', num_blocks=64,"
        " num_threads=1))\n"
        "print(d.model.fused_decode is None, d.model.small_head)\n"
    )
    env = dict(os.environ, BENCH_REF_KERNELS="0")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300, check=True)  # fmt: skip
    lines = result.stdout.split("\n")[:3]
    assert lines == ["False BENCH_REF_KERNELS=0", "True False", "True False"]
