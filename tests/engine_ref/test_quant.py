"""Quantized execution: the low-bit layers against float references, GGUF 4-bit blocks against
gguf.quants, and proof through `LLMEngine.step` that the low-bit kernels ran and no float
copy of a quantized weight is held; w4a8's greedy tokens against an emulation of its
arithmetic in float64 (and not of W4A16's)."""

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
    DynamicInt4Linear,
    DynamicInt8Linear,
    Int4Groups,
    Int4Linear,
    Int8Embedding,
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
needs_kernels = pytest.mark.skipif(
    not kernels.available(), reason=f"engine kernels off: {kernels.unavailable_reason()}"
)
# The low-bit kernel each mode's projections must run (profiler event names): torch's, and
# the engine's own for calls of at most kernels.SMALL_BATCH_ROWS rows where they build; w4a8
# and w8a8 run the engine's int8 kernels at any batch size where they build.
KERNELS = {
    "w4a16": "aten::_weight_int4pack_mm_for_cpu",
    "w4a8": "refkern::q4_i8_gemm",
    "w8a16": "aten::_weight_int8pack_mm",
    "w8a8": "quantized::linear_dynamic",
}
SMALL_KERNELS = {"w4a16": "refkern::q4_gemm", "w8a16": "refkern::q8_gemm"}
INT8_KERNEL = "aten::_weight_int8pack_mm"
INT8_ACTIVATIONS = "refkern::q8_i8_gemm"


def expected_kernel_calls(mode: str, layers: int, rows: int) -> dict[str, int]:
    """Low-bit kernel calls of one forward of `rows` rows through `layers` layers plus the
    output projection (on the rows that sample), for the kernels this machine runs."""
    small = kernels.available() and rows <= kernels.SMALL_BATCH_ROWS
    int8 = "refkern::q8_gemm" if small else INT8_KERNEL
    if mode == "w8a8" and kernels.available():  # every projection and the output one
        return {INT8_ACTIVATIONS: 4 * layers + 1}
    if mode == "w8a8":  # on fbgemm down_proj runs W8A16 (its activations have outliers)
        return {KERNELS[mode]: 3 * layers + 1, int8: layers}
    if mode == "w4a8":  # the output projection too has int8 activations
        return {KERNELS[mode]: 4 * layers, INT8_ACTIVATIONS: 1}
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


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x after per-row symmetric int8 quantisation (scale amax / 127), in float64."""
    amax = x.abs().amax(dim=1, keepdim=True)
    step = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round((x / step).clamp(-127, 127)).double() * step.double()


@pytest.mark.parametrize("engine_kernels", [True, False])
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_dynamic_int8_linear_is_an_exact_int8_gemm(rows, engine_kernels, monkeypatch):
    if engine_kernels and not kernels.available():
        pytest.skip(f"engine kernels off: {kernels.unavailable_reason()}")
    monkeypatch.setattr(kernels, "available", lambda build=True: engine_kernels)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 64, generator=gen)
    x = torch.randn(rows, 64, generator=gen) * 3
    layer = DynamicInt8Linear(w)
    assert layer.engine_kernels is engine_kernels
    y = layer(x)
    assert y.shape == (rows, 80) and y.dtype == torch.float32
    if engine_kernels:  # +-127 weights, one activation scale per row
        q, scale = int8_per_row(w)
        emulated = _int8_activations(x)
    else:  # fbgemm: +-63 weights (no int16 saturation), one uint8 scale per call
        q, scale = int8_per_row(w, 63)
        emulated = _uint8_activations(x)
    weight = q.double() * scale.double().unsqueeze(1)
    # The int8 GEMM equals the emulation to float rounding.
    assert _relative_error(y, emulated @ weight.t()) < 1e-5
    assert _relative_error(y, x.double() @ weight.t()) < 3e-2


@needs_kernels
@pytest.mark.parametrize("rows", [1, 16, 17, 40])
def test_dynamic_int4_linear_is_an_exact_w4a8_gemm(rows):
    gen = torch.Generator().manual_seed(rows)
    groups = Int4Groups.quantize(torch.randn(96, 128, generator=gen) * 0.1)
    x = torch.randn(rows, 128, generator=gen)
    layer = DynamicInt4Linear(groups)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = layer(x)
    assert [e.name for e in prof.events()].count("refkern::q4_i8_gemm") == 1
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    weight = groups.dequantize().double()
    assert _relative_error(y, _int8_activations(x) @ weight.t()) < 1e-6
    assert _relative_error(y, x.double() @ weight.t()) > 1e-3  # int8 activations, not float


def test_modes_and_devices():
    with pytest.raises(EngineConfigError, match="Unknown quantization 'w4a4'"):
        EngineConfig(model="tiny-random", quantization="w4a4")
    assert EngineConfig(model="tiny-random", quantization="w4a8").quantization == "w4a8"
    for mode in ("w8a8", "w4a8"):
        with pytest.raises(QuantizationError, match="CPU only"):
            check_supported(mode, torch.device("cuda"))
    check_supported("w4a16", torch.device("cuda"))  # the CUDA int4 kernel
    check_supported(None, torch.device("cuda"))


def test_cli_rejects_an_unknown_mode_in_one_sentence():
    result = CliRunner().invoke(serve, ["--model", "tiny-random", "--quantization", "int3"])
    assert result.exit_code == 2
    assert "Unknown quantization 'int3'" in result.output and "w4a8" in result.output
    assert "Traceback" not in result.output


def test_w4a8_without_the_engine_kernels_is_one_sentence(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda build=True: False)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: "BENCH_REF_KERNELS=0")
    with pytest.raises(QuantizationError, match=r"engine's own kernels, which are off here "
                       r"\(BENCH_REF_KERNELS=0\); use w4a16 or w8a8\.$"):  # fmt: skip
        check_supported("w4a8", CPU)
    check_supported("w8a8", CPU)  # fbgemm


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


# w8a8 once more with the engine kernels off: fbgemm, and down_proj in W8A16.
@pytest.mark.parametrize(
    ("mode", "kernels_off"), [(m, False) for m in sorted(KERNELS)] + [("w8a8", True)]
)
def test_step_runs_low_bit_kernels_and_holds_no_float_weight(
    mode, kernels_off, tiny_model, monkeypatch
):
    if mode == "w4a8" and not kernels.available():
        pytest.skip(f"engine kernels off: {kernels.unavailable_reason()}")
    if kernels_off:
        monkeypatch.setattr(kernels, "available", lambda build=True: False)
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
    if mode == "w4a8":  # the fused layer runs W4A16 arithmetic: never for w4a8
        expected |= {"refkern::decode_layer": 0, "refkern::q4_gemm": 0}
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


@needs_kernels
def test_w4a8_weight_bytes_are_the_q4_1_size(tiny_model):
    # One copy of the int4 weights (16 B of nibbles, a float16 scale and minimum per 32); the
    # output projection's int8 rows plus a float32 scale and int32 row sum each; the
    # embedding's own int8 rows and float32 scales.
    engine = _engine("w4a8")
    c = tiny_model.config
    kinds = weight_bytes_by_kind(engine.model)
    assert kinds["mlp"] == c.num_hidden_layers * 3 * c.hidden_size * c.intermediate_size * 20 // 32
    assert kinds["lm_head"] == c.vocab_size * (c.hidden_size + 8)
    assert kinds["embedding"] == c.vocab_size * (c.hidden_size + 4)


class _EmulatedLinear(torch.nn.Module):
    """y = x' @ weight.T in float64, x' = x after per-row int8 quantisation (`int8`) or x."""

    def __init__(self, weight: torch.Tensor, int8: bool) -> None:
        super().__init__()
        self.weight, self.int8 = weight.double(), int8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        rows = _int8_activations(rows) if self.int8 else rows.double()
        return (rows @ self.weight.t()).float().view(*x.shape[:-1], -1)


def _emulated_engine(loaded, int8: bool) -> LLMEngine:
    """A float32 engine whose projections compute W4A8's (or W4A16's, `int8` false)
    arithmetic in float64 from the same int4 groups, with W4A8's int8 output projection and
    embedding, through the Python layers."""
    engine = LLMEngine(EngineConfig(model="tiny-random", dtype="float32", num_blocks=64,
                                    num_threads=1), loaded=loaded)  # fmt: skip
    model = engine.model
    model.fused_decode, model.small_head = None, False
    for layer in model.layers:
        for owner, name in [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]:  # fmt: skip
            groups = Int4Groups.quantize(getattr(owner, name).weight)
            setattr(owner, name, _EmulatedLinear(groups.dequantize(), int8))
    q, scale = int8_per_row(model.lm_head.weight)
    model.lm_head = _EmulatedLinear(q.double() * scale.double().unsqueeze(1), int8)
    model.embed_tokens = Int8Embedding(q, scale, torch.float32)
    return engine


def _greedy_with_logprobs(engine: LLMEngine, prompts, max_tokens: int):
    """Each prompt's greedy tokens, and per output token the log-probabilities of the top 3
    tokens ({token: logprob}; tiny-random is so sure of its first choice that its own
    log-probability is 0 in float32, while the others' are about -25)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=3)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list[dict[int, float]]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].new_token_ids
            logprobs[out.request_id] += out.outputs[0].logprobs or []
    keys = [str(i) for i in range(len(prompts))]
    return [tokens[k] for k in keys], [lp for k in keys for lp in logprobs[k]]


def _largest_difference(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
    """The largest |logprob difference| over positions with the same top-3 tokens; inf if
    any position's top 3 differ."""
    if any(x.keys() != y.keys() for x, y in zip(a, b, strict=True)):
        return float("inf")
    return max(abs(x[t] - y[t]) for x, y in zip(a, b, strict=True) for t in x)


@needs_kernels
def test_w4a8_engine_computes_w4a8_arithmetic(tiny_model):
    # Through LLMEngine.step: w4a8's greedy tokens and top log-probabilities are those of a
    # float64 emulation of int8 activations x int4 groups, and measurably not those of the
    # same weights with float activations (W4A16 arithmetic): the check tells them apart.
    w4a8 = LLMEngine(EngineConfig(model="tiny-random", dtype="float32", num_blocks=64,
                                  num_threads=1, quantization="w4a8"), loaded=tiny_model)  # fmt: skip
    assert w4a8.model.fused_decode is None
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41], list(range(100, 130))]
    tokens, logprobs = _greedy_with_logprobs(w4a8, prompts, 6)
    emulated, emulated_logprobs = _greedy_with_logprobs(
        _emulated_engine(tiny_model, True), prompts, 6
    )
    _, a16_logprobs = _greedy_with_logprobs(_emulated_engine(tiny_model, False), prompts, 6)
    assert tokens == emulated and all(len(t) == 6 for t in tokens)
    assert _largest_difference(logprobs, emulated_logprobs) < 1e-3
    assert _largest_difference(logprobs, a16_logprobs) > 1e-2


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
