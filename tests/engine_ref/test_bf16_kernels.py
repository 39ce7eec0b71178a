"""bfloat16 weights in the engine's own kernels (`engine_ref.core.kernels.bf16`): `bf16_gemm`
against a float64 product at the row-pass and batch bounds and at K / N tails, a row's result
independent of its batch, and a bfloat16 engine through `LLMEngine.step`: one fused
`decode_layer` per layer plus the `bf16_gemm` head up to `BF16_SMALL_BATCH_ROWS` rows, the
Python layers' greedy tokens on tiny-random (decode, prefill, token trees), and on SmolLM2
logits nearer the float32 engine's than the Python bf16 layers' are."""

from __future__ import annotations

import json

import pytest
import torch
from benchmark_scripts import load_benchmark
from greedy_util import greedy_tokens
from torch.profiler import ProfilerActivity, profile

from engine_ref import EngineConfig, LLMEngine, SamplingParams, build_engine
from engine_ref.core import kernels
from engine_ref.core.attention import build_attention_metadata, kv_pool_shape
from engine_ref.core.engine_config import SpeculativeConfig
from engine_ref.core.kernels import bf16

CPU = torch.device("cpu")
BOUND = bf16.BF16_SMALL_BATCH_ROWS
needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"engine kernels off: {kernels.unavailable_reason()}"
)


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def _kernel_calls(fn) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for event in prof.events():
        counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def _reference(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ weight.T in float64 (x rounded to bfloat16 first where the kernel does so), and the
    bound on a float32 sum's error that goes with it: K 2^-24 |x| @ |weight|.T (each product is
    exact, each of the K additions rounds once)."""
    if bf16.activations_in_bf16():
        x = x.bfloat16()
    x, weight = x.double(), weight.double()
    bound = weight.shape[1] * 2.0**-24 * (x.abs() @ weight.abs().t())
    return x @ weight.t(), bound


def _error_within(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    ref, bound = _reference(x, weight)
    return bool(((y.double() - ref).abs() <= bound).all())


@needs_kernels
@pytest.mark.parametrize("k", [16, 37, 48, 576, 1536])
@pytest.mark.parametrize("n", [1, 3, 5, 17])
@pytest.mark.parametrize("m", [1, 8, 9, BOUND, BOUND + 1])
def test_bf16_gemm_matches_a_float64_product(m, n, k):
    # m: one row, a full pass of 8 and one more, the engine's bound and one more; n: weight
    # rows in blocks of up to 4 and the ones left over; k: whole chunks (16 and 32 weights)
    # and tails of every kind (37: 5 after 32; 48: 16 after 32).
    gen = torch.Generator().manual_seed(m * 10000 + n * 100 + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen)
    y = bf16.bf16_gemm(x, weight)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert _error_within(y, x, weight)


@needs_kernels
@pytest.mark.parametrize("k", [37, 576])
def test_bf16_gemm_checks_against_the_wrong_reference_fail(k):
    # Negative control for the test above: the weights' rows swapped, or one weight doubled
    # (in a chunk, or in the tail), is outside the bound.
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(17, k, generator=gen).bfloat16()
    x = torch.randn(3, k, generator=gen)
    y = bf16.bf16_gemm(x, weight)
    assert not _error_within(y, x, weight.flip(0))
    for column in (3, k - 1):
        nudged = weight.clone()
        nudged[4, column] *= 2
        assert not _error_within(y, x, nudged)


@needs_kernels
@pytest.mark.parametrize("m", [2, 9, BOUND])
def test_a_rows_bf16_result_does_not_depend_on_its_batch(m):
    # What keeps greedy decoding identical with and without speculation in a bf16 engine.
    gen = torch.Generator().manual_seed(m)
    weight = torch.randn(33, 576, generator=gen).bfloat16()
    x = torch.randn(m, 576, generator=gen)
    whole = bf16.bf16_gemm(x, weight)
    for i in (0, m // 2, m - 1):
        assert torch.equal(whole[i], bf16.bf16_gemm(x[i : i + 1], weight)[0])


@needs_kernels
def test_bf16_gemm_bad_input_is_one_sentence():
    with pytest.raises(RuntimeError, match=r"weight must be contiguous bfloat16 \[N, K\]"):
        bf16.bf16_gemm(torch.randn(1, 32), torch.randn(4, 32))
    with pytest.raises(RuntimeError, match="x has 16 columns, the weight 32"):
        bf16.bf16_gemm(torch.randn(1, 16), torch.randn(4, 32).bfloat16())


# bf16's step at 1 is 2^-7: 1 + f rounds to nearest even (f = 2^-8 is a tie: down to the even
# 1.0; 3 * 2^-8 a tie: up to the even 1 + 2^-6; 1 - 2^-9 a tie: up to 1.0).
FRACTIONS = torch.tensor([3, 1, 2, 6, 5, 7, -1, -3, 2, 6, 0, 1, 3, 5, -2, 4]) * 2.0**-9


def _one_row_layer(pool: torch.Tensor) -> torch.Tensor:
    """decode_layer on one row of ones through a 16-wide layer (one head of 16, eps 0) whose
    key and value element j are 1 + FRACTIONS[j], stored at slot 3 of `pool` [2, 1, 16, 16]:
    the normed row is ones exactly, each of those sums two bf16 weights exactly in float32,
    and RoPE is the identity (cos 1, sin 0)."""
    d = 16
    qkv = torch.zeros(3 * d, d)
    for j in range(d):
        for head in (1, 2):  # key, value
            qkv[head * d + j, j], qkv[head * d + j, (j + 1) % d] = 1.0, FRACTIONS[j]
    zeros = torch.zeros(d, d, dtype=torch.bfloat16)
    unused, norm = torch.empty(0), torch.ones(d)
    weights = [norm, qkv.bfloat16(), unused, unused, zeros, unused, unused, norm,
               torch.zeros(2 * d, d, dtype=torch.bfloat16), unused, unused, zeros, unused,
               unused]  # fmt: skip
    long = dict(dtype=torch.long)
    return torch.ops.refkern.decode_layer(
        torch.ones(1, d), weights, torch.ones(1, d), torch.zeros(1, d), pool,
        torch.tensor([3], **long), torch.tensor([[0]], **long), torch.tensor([4], **long),
        torch.empty(0, **long), torch.empty(0, **long), 1, 0.0, 0.25,
    )  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_decode_layer_stores_its_kv_rounded_to_nearest_even(pool_dtype):
    pool = torch.zeros(2, 1, 16, 16, dtype=pool_dtype)
    out = _one_row_layer(pool)
    expected = (1 + FRACTIONS).to(pool_dtype)  # torch rounds to nearest even
    assert torch.equal(pool[0, 0, 3], expected) and torch.equal(pool[1, 0, 3], expected)
    if pool_dtype == torch.bfloat16:  # the case covers the ties and a 0.75-step round up
        assert expected[[2, 3, 0, 6]].tolist() == [1.0, 1 + 2.0**-6, 1 + 2.0**-7, 1.0]
    assert torch.equal(out, torch.ones(1, 16))  # zero o_proj and down_proj: x passes through


@needs_kernels
def test_decode_layer_names_the_pool_dtypes_it_takes():
    with pytest.raises(RuntimeError, match="kv_pool must be a contiguous float32, bfloat16, "
                       "float16, int8 or float8_e4m3fn"):  # fmt: skip
        _one_row_layer(torch.zeros(2, 1, 16, 16, dtype=torch.float64))


# -- a bfloat16 engine through LLMEngine.step ----------------------------------------------------


def _engine(**overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="bfloat16", device="cpu", num_blocks=256,
                   num_threads=1, enable_prefix_caching=False)  # fmt: skip
    options.update(overrides)
    return build_engine(EngineConfig(**options))


def _prompts(count: int) -> list[list[int]]:
    # Contexts that cross the 16-token block boundary while decoding, and a 40-token prompt.
    lengths = [14, 15, 16, 17, 40, 3, 31, 32, 33, 1, 2, 5, 8, 13, 21, 34, 55]
    return [[(7 * i + 3 * j) % 200 + 1 for j in range(lengths[i % len(lengths)])]
            for i in range(count)]  # fmt: skip


def _python_layers(engine: LLMEngine) -> None:
    """Send every later step through the Python layers and torch's head GEMM."""
    engine.model.fused_decode = None
    engine.model.small_head = False


@needs_kernels
def test_a_bf16_engine_holds_bf16_weights_and_pool_for_the_fused_layer():
    engine = _engine()
    model = engine.model
    assert model.fused_max_rows == BOUND and model.small_head
    layer = model.fused_decode[0]
    assert [layer[i].dtype for i in (1, 4, 8, 11)] == [torch.bfloat16] * 4
    assert layer[0].dtype == layer[7].dtype == torch.float32  # the norms, widened once
    assert all(pool.dtype == torch.bfloat16 for pool in engine.model_runner.kv_caches)


@needs_kernels
@pytest.mark.parametrize("batch", [1, BOUND, BOUND + 1])
def test_bf16_fused_decode_gives_the_python_layers_tokens(batch):
    engine = _engine()
    prompts = _prompts(batch)
    fused = greedy_tokens(engine, prompts, 16)
    _python_layers(engine)
    assert fused == greedy_tokens(engine, prompts, 16)


@needs_kernels
def test_a_fused_layer_with_wrong_weights_gives_other_tokens():
    # Negative control for the comparison above: the tokens do depend on what the fused
    # layer computes (here its o_proj weights, scaled by 4 in every layer).
    engine = _engine()
    prompts = _prompts(4)
    fused = greedy_tokens(engine, prompts, 16)
    for layer in engine.model.fused_decode:
        layer[4] = layer[4] * 4
    assert greedy_tokens(engine, prompts, 16) != fused


@needs_kernels
@pytest.mark.parametrize(("batch", "fused_calls"), [(BOUND, 1), (BOUND + 1, 0)])
def test_a_bf16_decode_step_runs_one_fused_call_per_layer_and_the_bf16_head(batch, fused_calls):
    engine = _engine()
    for i, ids in enumerate(_prompts(batch)):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # the prefills: more rows than the bound, so the Python layers
    calls = _kernel_calls(engine.step)  # one decode step of every row
    layers = engine.model_config.num_hidden_layers
    assert calls.get("refkern::decode_layer", 0) == fused_calls * layers
    assert calls.get("refkern::bf16_gemm", 0) == fused_calls * (4 * layers + 1)
    torch_gemms = calls.get("aten::mm", 0) + calls.get("aten::addmm", 0)
    assert torch_gemms == (1 - fused_calls) * (4 * layers + 1)


@needs_kernels
def test_a_bf16_w4a16_engine_fuses_its_int4_layers_over_a_bf16_pool():
    # int4 projections (at most SMALL_BATCH_ROWS rows, as in float32) with the bf16 KV pool.
    engine = _engine(quantization="w4a16")
    assert engine.model.fused_max_rows == kernels.SMALL_BATCH_ROWS
    prompts = _prompts(kernels.SMALL_BATCH_ROWS)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    calls = _kernel_calls(engine.step)
    layers = engine.model_config.num_hidden_layers
    assert calls.get("refkern::decode_layer", 0) == layers
    assert calls.get("refkern::q4_gemm", 0) == 4 * layers
    fused = greedy_tokens(engine, prompts, 12)
    _python_layers(engine)
    assert fused == greedy_tokens(engine, prompts, 12)


@needs_kernels
def test_a_prefill_chunk_up_to_the_bound_is_fused_and_gives_the_same_tokens():
    prompts = [[(5 * i + j) % 300 + 1 for j in range(n)] for i, n in enumerate([30, 1, 17])]
    engine = _engine()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=6, temperature=0))
    calls = _kernel_calls(engine.step)  # 48 prefill rows in one step
    assert calls.get("refkern::decode_layer", 0) == engine.model_config.num_hidden_layers
    while engine.has_unfinished():
        engine.step()
    fused = greedy_tokens(engine, prompts, 12)
    _python_layers(engine)
    assert fused == greedy_tokens(engine, prompts, 12)


@needs_kernels
def test_bf16_token_tree_verify_steps_are_fused_and_give_the_python_layers_tokens():
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1,
                             num_tree_branches=3, disable_by_batch_size=None)  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    runs, seen = [], {}
    for fused in (True, False):
        engine = _engine(speculative_config=spec)
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


def test_a_bf16_engine_does_not_wait_for_the_first_build(monkeypatch):
    # As a float32 engine: while the library is not built, torch's kernels serve (the build
    # runs in the background) and nothing is fused.
    asked = []

    def not_built_yet(build: bool = True) -> bool:
        asked.append(build)
        return False

    monkeypatch.setattr(kernels, "available", not_built_yet)
    engine = _engine()
    assert engine.model.fused_decode is None and not engine.model.small_head
    assert asked and not any(asked)  # never asked to build in the foreground
    assert greedy_tokens(engine, _prompts(2), 4)


def _chunked_logits(engine: LLMEngine, ids: list[int], chunk: int) -> torch.Tensor:
    """float32 logits of every position, `ids` fed `chunk` at a time into a scratch pool of
    the engine's dtype."""
    mc, bs = engine.model_config, engine.config.block_size
    blocks = -(-len(ids) // bs)
    shape = kv_pool_shape(blocks, bs, mc.num_key_value_heads, mc.head_dim)
    pools = [torch.zeros(shape, dtype=engine.dtype) for _ in range(mc.num_hidden_layers)]
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            meta = build_attention_metadata(
                start_positions=[start], num_new_tokens=[len(piece)],
                block_tables=[list(range(blocks))], block_size=bs,
                num_queries_per_kv=mc.num_attention_heads // mc.num_key_value_heads,
                num_kv_heads=mc.num_key_value_heads, num_pool_blocks=blocks, device=CPU,
                dtype=engine.dtype,
            )  # fmt: skip
            positions = torch.arange(start, start + len(piece))
            hidden = engine.model(torch.tensor(piece), positions, meta, pools)
            out.append(engine.model.compute_logits(hidden).float())
    return torch.cat(out)


@needs_kernels
@pytest.mark.parametrize("chunk", [1, 7, BOUND])
def test_bf16_fused_logits_are_nearer_float32_than_the_python_layers(chunk):
    # tiny-random's greedy tokens hardly depend on its attention (they stayed the same with
    # the fused layer's values halved), so its logits are checked as well: against the
    # float32 engine over 100 positions (measured: 5.7e-3 fused, 8e-3 Python bf16 layers).
    ids = [(13 * j) % 400 + 1 for j in range(100)]
    reference = _chunked_logits(_engine(dtype="float32"), ids, chunk).double()
    engine = _engine()
    fused = _chunked_logits(engine, ids, chunk)
    _python_layers(engine)
    python = _chunked_logits(engine, ids, chunk)
    fused_error = _relative_error(fused, reference)
    assert fused_error < _relative_error(python, reference) and fused_error < 1e-2


@needs_kernels
@pytest.mark.slow  # SmolLM2 in two dtypes, 60 positions through three paths (about 15 s)
def test_smollm2_bf16_fused_logits_are_nearer_float32_than_the_python_layers(smollm2_path):
    # The fused layer keeps activations in float32 where the Python bf16 layers round every
    # op's output: against the float32 engine its logits must be the nearer ones (measured:
    # 8e-3 against 1.9e-2 relative error) and bf16-close.
    text = ("The quick brown fox jumps over the lazy dog. In the beginning the universe was "
            "created. This has made a lot of people very angry and been widely regarded as a "
            "bad move.")  # fmt: skip
    reference_engine = _engine(model="smollm2-135m", dtype="float32", num_blocks=16)
    ids = reference_engine.tokenizer.encode(text)
    reference = _chunked_logits(reference_engine, ids, 7).double()
    del reference_engine
    engine = _engine(model="smollm2-135m", num_blocks=16)
    fused = _chunked_logits(engine, ids, 7)
    _python_layers(engine)
    python = _chunked_logits(engine, ids, 7)
    fused_error = _relative_error(fused, reference)
    assert fused_error < 0.75 * _relative_error(python, reference)
    assert fused_error < 2e-2


def test_decode_paths_benchmark_passes_its_options_on_without_isa_and_json():
    bench = load_benchmark("decode_paths")
    argv = ["--isa", "avx2,avx512", "--rows", "1", "--json=out.json", "--steps", "10"]
    assert bench.without_options(argv, ("--isa", "--json")) == ["--rows", "1", "--steps", "10"]


@needs_kernels
def test_decode_paths_benchmark_tiny_run(tmp_path, capsys):
    bench = load_benchmark("decode_paths")
    out = tmp_path / "paths.json"
    args = ["--model", "tiny-random", "--rows", "1,2", "--repeats", "3", "--steps", "10",
            "--warmup", "1", "--threads", "1", "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    assert report["isa"] == kernels.active_isa()
    assert set(report["runs"]) == {"1", "2"}
    for by_path in report["runs"].values():
        assert set(by_path) == set(bench.DEFAULT_PATHS)
        assert all(len(times) == 30 and min(times) > 0 for times in by_path.values())
    table = capsys.readouterr().out
    assert "bfloat16-torch" in table and "x floor" in table and "RSS" in table


@needs_kernels
def test_decode_paths_benchmark_runs_the_quantized_paths(tmp_path, capsys):
    """The single-stream table's quantized rows: each a float32 engine with that quantization
    (tiny-random's int4 comes from its float weights), its W4A16 layers fused."""
    bench = load_benchmark("decode_paths")
    out = tmp_path / "paths.json"
    args = ["--model", "tiny-random", "--rows", "1", "--repeats", "3", "--steps", "10",
            "--warmup", "1", "--threads", "1", "--paths", "w4a16,w4a8,w8a8,floor",
            "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    by_path = json.loads(out.read_text())["runs"]["1"]
    assert set(by_path) == {"w4a16", "w4a8", "w8a8", "floor"}
    assert all(len(times) == 30 and min(times) > 0 for times in by_path.values())
    table = capsys.readouterr().out
    assert all(f" {path} " in table for path in ("w4a16", "w4a8", "w8a8"))
    with pytest.raises(SystemExit):  # a path it does not know is refused
        bench.main([*args[:-4], "--paths", "w4a4"])
