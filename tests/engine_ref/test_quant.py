"""Quantized execution: the low-bit layers against float references, GGUF 4-bit blocks against
gguf.quants, and proof through `LLMEngine.step` that the low-bit kernels ran and no float
copy of a quantized weight is held."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import urllib.request

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf_writer_util import write_llama_gguf
from greedy_util import greedy_tokens
from server_fixtures import running_server
from torch.profiler import ProfilerActivity, profile

from engine_ref import EngineConfig, EngineConfigError, LLMEngine, SamplingParams, build_engine
from engine_ref.core import kernels
from engine_ref.core.quant import (
    DynamicInt8Linear,
    Int4Groups,
    Int4Linear,
    Int8Linear,
    QuantizationError,
    check_supported,
    int8_per_row,
    weight_bytes_by_kind,
)
from engine_ref.loading.dequant import int4_groups
from engine_ref.loading.weights import load_model
from engine_ref.serving.cli_serve import serve
from engine_ref.serving.server import ServerConfig

CPU = torch.device("cpu")
# The low-bit kernel each mode's projections must run (profiler event names): torch's, and
# the engine's own for calls of at most kernels.SMALL_BATCH_ROWS rows where they build.
KERNELS = {
    "w4a16": "aten::_weight_int4pack_mm_for_cpu",
    "w8a16": "aten::_weight_int8pack_mm",
    "w8a8": "quantized::linear_dynamic",
}
SMALL_KERNELS = {"w4a16": "refkern::q4_gemm", "w8a16": "refkern::q8_gemm"}
INT8_KERNEL = "aten::_weight_int8pack_mm"


def expected_kernel_calls(mode: str, layers: int, rows: int) -> dict[str, int]:
    """Low-bit kernel calls of one forward of `rows` rows through `layers` layers plus the
    output projection (on the rows that sample), for the kernels this machine runs."""
    small = kernels.available() and rows <= kernels.SMALL_BATCH_ROWS
    int8 = "refkern::q8_gemm" if small else INT8_KERNEL
    if mode == "w8a8":  # down_proj runs W8A16 (its activations have outliers)
        return {KERNELS[mode]: 3 * layers + 1, int8: layers}
    main = SMALL_KERNELS[mode] if small else KERNELS[mode]
    calls = {main: 4 * layers}  # qkv, o, gate_up, down
    calls[int8] = calls.get(int8, 0) + 1  # the output projection is W8A16
    return calls


def int4_bytes_per_32() -> int:
    """Bytes an int4 layer holds per 32 weights: torch's packing (16 B of nibbles, a bf16 scale
    and zero: 20 B, Q4_1's size), plus, where the engine's kernels run, their own copy (16 B of
    nibbles, a float16 scale and minimum: 20 B again)."""
    return 20 + (20 if kernels.available() else 0)


# Float matmul ops a projection would run through F.linear (attention's own score and value
# products are aten::matmul over the KV cache, not weights).
FLOAT_MATMULS = {"aten::linear", "aten::addmm", "aten::mm"}


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


# -- formats ------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1])
def test_gguf_4bit_blocks_decode_as_gguf_quants_does(qtype):
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(6, 96)).astype(np.float32)
    raw = gguf.quants.quantize(weight, qtype)  # [6, 3 blocks * bytes]
    groups = int4_groups(raw, qtype, (6, 96))
    assert groups.group_size == 32 and groups.q.dtype == torch.uint8
    assert int(groups.q.max()) <= 15
    expected = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_allclose(groups.dequantize().numpy(), expected, rtol=0, atol=1e-6)


def test_other_types_have_no_4bit_groups():
    assert int4_groups(np.zeros(34, np.uint8), gguf.GGMLQuantizationType.Q8_0, (1, 32)) is None
    assert int4_groups(np.zeros(20, np.uint8), gguf.GGMLQuantizationType.Q4_1, (32,)) is None


def test_quantize_follows_llama_cpp_q4_1():
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(5, 64)).astype(np.float32)
    weight[2, :32] = 0.75  # a constant group: scale 0, every value is the minimum
    ours = Int4Groups.quantize(torch.from_numpy(weight))
    theirs = int4_groups(
        gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1),
        gguf.GGMLQuantizationType.Q4_1,
        (5, 64),
    )
    assert torch.equal(ours.scale, theirs.scale) and torch.equal(ours.minimum, theirs.minimum)
    # llama.cpp rounds (x - min) / d in float32 with a reciprocal; allow an off-by-one at ties.
    assert int((ours.q.int() - theirs.q.int()).abs().max()) <= 1
    assert float((ours.q != theirs.q).float().mean()) < 0.01
    assert torch.all(ours.dequantize()[2, :32] == 0.75)


@pytest.mark.parametrize("in_features", [31, 33, 48])
def test_4bit_groups_need_whole_groups(in_features):
    with pytest.raises(QuantizationError, match="divisible by 32"):
        Int4Groups.quantize(torch.zeros(4, in_features))


def test_int8_per_row_hand_case():
    q, scale = int8_per_row(torch.tensor([[1.27, -0.635, 0.0], [0.0, 0.0, 0.0]]))
    assert q.tolist() == [[127, -64, 0], [0, 0, 0]]  # -63.5 rounds half to even: -64
    assert scale.tolist() == pytest.approx([0.01, 1.0])


# -- layers against float references ------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_linear_matches_its_dequantized_weights(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 128, generator=gen) * 0.1
    groups = Int4Groups.quantize(weight)
    x = torch.randn(rows, 128, generator=gen)
    y = Int4Linear(groups, CPU)(x)
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    # bf16 activations and bf16 scales: about 2^-8 relative error against the exact product.
    assert _relative_error(y, x.double() @ groups.dequantize().double().t()) < 1e-2


@pytest.mark.parametrize("rows", [1, 64])
def test_int8_linear_matches_its_dequantized_weights(rows):
    gen = torch.Generator().manual_seed(rows)
    q, scale = int8_per_row(torch.randn(80, 64, generator=gen))
    x = torch.randn(rows, 64, generator=gen)
    ref = x.double() @ (q.double() * scale.double().unsqueeze(1)).t()
    y = Int8Linear(q, scale)(x)
    assert y.shape == (rows, 80) and y.dtype == torch.float32
    assert _relative_error(y, ref) < 1e-2  # bf16 activations


def _uint8_activations(x: torch.Tensor) -> torch.Tensor:
    """x after per-call asymmetric uint8 quantisation (an independent emulation of fbgemm's
    dynamic quantisation: the range includes 0, scale (max - min) / 255)."""
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    step = (high - low) / 255
    zero = round(-low / step)
    return ((torch.round(x.double() / step) + zero).clamp(0, 255) - zero) * step


@pytest.mark.parametrize("rows", [1, 17, 64])
def test_dynamic_int8_linear_is_an_exact_int8_gemm(rows):
    gen = torch.Generator().manual_seed(rows)
    q, scale = int8_per_row(torch.randn(80, 64, generator=gen), 63)
    x = torch.randn(rows, 64, generator=gen) * 3
    weight = q.double() * scale.double().unsqueeze(1)
    y = DynamicInt8Linear(q, scale)(x)
    assert y.shape == (rows, 80) and y.dtype == torch.float32
    # No int16 saturation at +-63: the int8 GEMM equals the emulation to float rounding.
    assert _relative_error(y, _uint8_activations(x) @ weight.t()) < 1e-5
    assert _relative_error(y, x.double() @ weight.t()) < 3e-2


def test_modes_and_devices():
    with pytest.raises(EngineConfigError, match="Unknown quantization 'w4a8'"):
        EngineConfig(model="tiny-random", quantization="w4a8")
    with pytest.raises(QuantizationError, match="CPU only"):
        check_supported("w8a8", torch.device("cuda"))
    check_supported("w4a16", torch.device("cuda"))  # the CUDA int4 kernel
    check_supported(None, torch.device("cuda"))


def test_cli_rejects_an_unknown_mode_in_one_sentence():
    result = CliRunner().invoke(serve, ["--model", "tiny-random", "--quantization", "int3"])
    assert result.exit_code == 2
    assert "Unknown quantization 'int3'" in result.output and "w4a16" in result.output
    assert "Traceback" not in result.output


# -- through the engine -------------------------------------------------------------------------


def _engine(mode, **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=64,
                   num_threads=1, quantization=mode)  # fmt: skip
    options.update(overrides)
    return build_engine(EngineConfig(**options))


def _float_weight_tensors(shapes: set[tuple[int, ...]]) -> set[int]:
    """Storage addresses of every live floating tensor whose shape is one of `shapes`."""
    found = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.is_floating_point():
            if tuple(obj.shape) in shapes:
                found.add(obj.untyped_storage().data_ptr())
    return found


def _weight_shapes(loaded) -> set[tuple[int, ...]]:
    shapes = {tuple(t.shape) for n, t in loaded.state_dict.items() if not n.endswith("norm.weight")}
    c = loaded.config
    hd, h, kvh = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    shapes |= {((h + 2 * kvh) * hd, c.hidden_size), (2 * c.intermediate_size, c.hidden_size)}
    return shapes | {s[::-1] for s in shapes}


@pytest.mark.parametrize("mode", sorted(KERNELS))
def test_step_runs_low_bit_kernels_and_holds_no_float_weight(mode, tiny_model):
    shapes = _weight_shapes(tiny_model)
    before = _float_weight_tensors(shapes)
    engine = _engine(mode)  # loads tiny-random itself and drops the float weights
    gc.collect()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=3, temperature=0))
    engine.step()  # the prefill
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outputs = engine.step()  # a decode step of both
    assert sorted(o.request_id for o in outputs) == ["0", "1"]
    counts: dict[str, int] = {}
    for event in prof.events():
        counts[event.name] = counts.get(event.name, 0) + 1
    expected = expected_kernel_calls(mode, engine.model_config.num_hidden_layers, rows=2)
    if mode == "w4a16" and kernels.available():  # a decode step of 2 rows: one call a layer
        expected["refkern::decode_layer"] = engine.model_config.num_hidden_layers
    for kernel, n in expected.items():
        assert counts.get(kernel, 0) == n, (kernel, counts.get(kernel))
    assert not FLOAT_MATMULS & counts.keys(), FLOAT_MATMULS & counts.keys()
    held = _float_weight_tensors(shapes) - before
    assert not held, f"{len(held)} float tensors of a quantized layer's shape are held"
    for _, tensor in [*engine.model.named_parameters(), *engine.model.named_buffers()]:
        assert not (tensor.is_floating_point() and tuple(tensor.shape) in shapes)


def test_float_engine_counts_its_float_weights(tiny_model):
    engine = LLMEngine(
        EngineConfig(model="tiny-random", dtype="float32", num_blocks=64, num_threads=1),
        loaded=tiny_model,
    )
    c = tiny_model.config
    attention = (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * 16
                 + c.hidden_size * c.hidden_size)  # fmt: skip
    mlp = 3 * c.hidden_size * c.intermediate_size
    assert engine.stats().weight_bytes_by_kind == {
        "embedding": c.vocab_size * c.hidden_size * 4,  # tied: the output projection's too
        "attention": c.num_hidden_layers * attention * 4,
        "mlp": c.num_hidden_layers * mlp * 4,
        "norm": (2 * c.num_hidden_layers + 1) * c.hidden_size * 4,
        "lm_head": 0,
    }


def test_int4_weight_bytes_are_the_q4_1_size(tiny_model):
    engine = _engine("w4a16")
    c = tiny_model.config
    mlp_weights = c.num_hidden_layers * 3 * c.hidden_size * c.intermediate_size
    kinds = weight_bytes_by_kind(engine.model)
    assert kinds["mlp"] == mlp_weights * int4_bytes_per_32() // 32
    # int8 rows plus a float32 scale each; the tied lm_head adds its bf16 scales (and their
    # float32 copy for the engine's int8 kernel).
    assert kinds["embedding"] == c.vocab_size * (c.hidden_size + 4)
    assert kinds["lm_head"] == c.vocab_size * (2 + (4 if kernels.available() else 0))


def test_w4a16_runs_the_files_own_4bit_blocks(tmp_path, tiny_model):
    path = write_llama_gguf(
        tmp_path / "q41.gguf", tiny_model, linear_qtype=gguf.GGMLQuantizationType.Q4_1
    )
    loaded = load_model(path, dtype="float32", keep_int4=True)
    name = "model.layers.1.self_attn.q_proj.weight"
    # Q/K rows back in Hugging Face order, like the dequantised weights.
    assert torch.equal(loaded.int4_weights[name].dequantize(), loaded.state_dict[name])
    assert len(loaded.int4_weights) == 7 * loaded.config.num_hidden_layers
    config = dict(model="q41", dtype="float32", num_blocks=64, num_threads=1)
    dense = LLMEngine(EngineConfig(**config), loaded=loaded)
    w4 = LLMEngine(EngineConfig(**config, quantization="w4a16"), loaded=loaded)
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41]]
    layer = w4.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, loaded.config.hidden_size)
    ref = x.double() @ dense.model.layers[0].self_attn.qkv_proj.weight.double().t()
    assert isinstance(layer, Int4Linear) and _relative_error(layer(x), ref) < 1e-2
    # Greedy tokens mostly agree (bf16 activations, int8 output projection).
    a, b = greedy_tokens(dense, prompts, 8), greedy_tokens(w4, prompts, 8)
    assert sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True)) >= 8


def test_info_and_metrics_report_weight_bytes_per_layer_kind():
    engine = EngineConfig(model="tiny-random", dtype="float32", device="cpu", num_threads=1,
                          num_blocks=64, quantization="w4a16")  # fmt: skip
    with running_server(ServerConfig(engine=engine, port=0)) as url:
        with urllib.request.urlopen(url + "/info", timeout=30) as resp:
            info = json.loads(resp.read())
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
    assert info["quantization"] == "w4a16" and info["engine_config"]["quantization"] == "w4a16"
    kinds = info["weight_bytes_by_kind"]
    assert set(kinds) == {"embedding", "attention", "mlp", "norm", "lm_head"}
    mlp_weights = 4 * 3 * 64 * 128  # tiny-random: 4 layers, hidden 64, intermediate 128
    assert kinds["mlp"] == mlp_weights * int4_bytes_per_32() // 32
    for kind, num_bytes in kinds.items():
        line = f'vllm:model_weight_bytes{{layer_kind="{kind}",model_name="tiny-random"}}'
        assert f"{line} {float(num_bytes)}" in metrics, line


@pytest.mark.slow
def test_smollm2_w4a16_runs_the_files_q4_1_blocks(smollm2_path):
    engine = build_engine(EngineConfig(model=str(smollm2_path), num_blocks=64, num_threads=2,
                                       quantization="w4a16"))  # fmt: skip
    kinds = engine.stats().weight_bytes_by_kind
    c = engine.model_config
    projections = c.num_hidden_layers * (
        c.hidden_size * c.head_dim * (c.num_attention_heads + 2 * c.num_key_value_heads)
        + c.hidden_size * c.hidden_size
        + 3 * c.hidden_size * c.intermediate_size
    )
    assert kinds["attention"] + kinds["mlp"] == projections * int4_bytes_per_32() // 32
    ids = engine.tokenizer.encode("The capital of France is")
    engine.add_request("a", ids, SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    names = [event.name for event in prof.events()]
    for kernel, calls in expected_kernel_calls("w4a16", c.num_hidden_layers, rows=1).items():
        assert names.count(kernel) == calls, kernel
    assert not FLOAT_MATMULS & set(names)


@pytest.mark.serial
@pytest.mark.slow
def test_smollm2_w4a16_engine_gives_back_its_load_temporaries(smollm2_path):
    # Dequantising and quantising the weights frees ~750 MB in the middle of the malloc heap;
    # the engine hands it back, so what stays is torch (~220 MB), the weights (~160 MB), a
    # 64 MiB KV pool and the libraries: ~630 MB measured, against ~1,380 MB before.
    code = (
        "from engine_ref import EngineConfig, build_engine\n"
        f"e = build_engine(EngineConfig(model={str(smollm2_path)!r}, quantization='w4a16',"
        " kv_cache_memory_bytes=64 << 20, num_threads=1))\n"
        "rss = [l for l in open('/proc/self/status') if l.startswith('VmRSS')][0]\n"
        "print(int(rss.split()[1]) // 1024)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, check=True)  # fmt: skip
    assert int(result.stdout.strip().splitlines()[-1]) < 900
