import struct

import gguf
import numpy as np
import pytest
import torch
from gguf_writer_util import llama_cpp_permute

from engine_ref.loading.dequant import dequantize_to_torch
from engine_ref.loading.gguf_file import read_gguf, tensor_bytes
from engine_ref.loading.gguf_loader import hf_from_gguf_name, unpermute_qk
from engine_ref.loading.model_files import ModelFileError
from engine_ref.loading.weights import load_model, load_tokenizer


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def _q8_0_block(scale: float, qs: list[int]) -> bytes:
    return _f16(scale) + struct.pack("<32b", *qs)


def _q4_1_block(scale: float, minimum: float, nibbles: list[int]) -> bytes:
    # element j in the low nibble of byte j, element j + 16 in its high nibble
    packed = bytes(nibbles[j] | (nibbles[j + 16] << 4) for j in range(16))
    return _f16(scale) + _f16(minimum) + packed


def _write(path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]], **meta):
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def quant_file(tmp_path):
    q8 = list(range(-16, 16))
    q8_row0 = _q8_0_block(0.5, q8)
    q8_row1 = _q8_0_block(-0.25, q8[::-1])
    nib = [j % 16 for j in range(32)]
    q41 = _q4_1_block(0.25, -1.0, nib)
    tensors = {
        "q8": (
            np.frombuffer(q8_row0 + q8_row1, dtype=np.uint8).reshape(2, 34),
            gguf.GGMLQuantizationType.Q8_0,
        ),
        "q41": (np.frombuffer(q41, dtype=np.uint8).reshape(1, 20), gguf.GGMLQuantizationType.Q4_1),
        "f16": (np.array([[1.5, -2.0], [0.125, 65504.0]], dtype=np.float16), None),
        "f32": (np.arange(6, dtype=np.float32).reshape(3, 2) / 3, None),
    }
    return _write(
        tmp_path / "q.gguf",
        tensors,
        **{"test.name": "héllo", "test.list": ["a", "b c"], "test.n": 7},
    )


def _dequant(path, name):
    info = next(t for t in read_gguf(path).tensors if t.name == name)
    return info, dequantize_to_torch(tensor_bytes(path, info), info.ggml_type, info.shape).numpy()


def _random_blocks(rng, qtype, n_blocks):
    """Random block bytes with finite float16 scales in the leading scale fields."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    scale_bytes = {gguf.GGMLQuantizationType.Q4_1: 4, gguf.GGMLQuantizationType.Q5_1: 4}.get(
        qtype, 2
    )
    scales = rng.uniform(-2, 2, size=(n_blocks, scale_bytes // 2)).astype(np.float16)
    raw[:, :scale_bytes] = scales.view(np.uint8).reshape(n_blocks, scale_bytes)
    return raw, block_values


@pytest.mark.parametrize(
    "qtype",
    [
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q5_0,  # not a torch fast path: decoded by gguf.quants
    ],
)
def test_torch_dequant_matches_gguf_quants(qtype):
    rng = np.random.default_rng(1)
    raw, per_block = _random_blocks(rng, qtype, 24)
    ours = dequantize_to_torch(raw, qtype, (4, 6 * per_block))
    theirs = np.asarray(gguf.quants.dequantize(raw.reshape(4, -1), qtype), dtype=np.float32)
    np.testing.assert_array_equal(ours.numpy(), theirs)


def test_half_precision_types():
    values = np.array([1.5, -2.0, 0.0078125, 3.0e4], dtype=np.float32)
    f16 = values.astype(np.float16).view(np.uint8)
    assert dequantize_to_torch(f16, 1, (2, 2)).flatten().tolist() == values.tolist()
    as_bf16 = torch.from_numpy(values).to(torch.bfloat16)
    raw = as_bf16.view(torch.uint8).numpy()
    assert dequantize_to_torch(raw, 30, (4,)).tolist() == as_bf16.float().tolist()


def test_unknown_type_is_a_model_file_error():
    with pytest.raises(ModelFileError, match="cannot be dequantised"):
        dequantize_to_torch(np.zeros(8, np.uint8), 999, (8,))


def test_q8_0_dequantises_to_scale_times_int(quant_file):
    info, values = _dequant(quant_file, "q8")
    assert info.shape == (2, 32)
    # hand computation: row 0 = 0.5 * (-16 .. 15), row 1 = -0.25 * (15 .. -16)
    assert values[0].tolist() == [0.5 * q for q in range(-16, 16)]
    assert values[1].tolist() == [-0.25 * q for q in range(15, -17, -1)]


def test_q4_1_dequantises_to_scale_times_nibble_plus_min(quant_file):
    info, values = _dequant(quant_file, "q41")
    assert info.shape == (1, 32)
    assert values[0].tolist() == [0.25 * (j % 16) - 1.0 for j in range(32)]


def test_float_tensors_read_back(quant_file):
    assert _dequant(quant_file, "f16")[1].tolist() == [[1.5, -2.0], [0.125, 65504.0]]
    np.testing.assert_array_equal(
        _dequant(quant_file, "f32")[1], np.arange(6, dtype=np.float32).reshape(3, 2) / 3
    )


def test_reader_agrees_with_gguf_package(quant_file):
    ours = read_gguf(quant_file)
    theirs = gguf.GGUFReader(quant_file)
    assert ours.metadata["test.name"] == "héllo"
    assert ours.metadata["test.list"] == ["a", "b c"]
    assert ours.metadata["test.n"] == 7
    assert ours.metadata == {
        k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")
    }
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.name == ref.name
        assert mine.shape == tuple(reversed(ref.shape.tolist()))
        assert mine.ggml_type == ref.tensor_type
        np.testing.assert_array_equal(
            tensor_bytes(quant_file, mine).reshape(-1), ref.data.reshape(-1).view(np.uint8)
        )


def test_unpermute_single_head_by_hand():
    hf_rows = np.array([[1.0], [2.0], [3.0], [4.0]])  # head_dim 4: halves (1, 2) and (3, 4)
    gguf_rows = np.array([[1.0], [3.0], [2.0], [4.0]])  # interleaved pairs (1, 3), (2, 4)
    np.testing.assert_array_equal(llama_cpp_permute(hf_rows, 1), gguf_rows)
    np.testing.assert_array_equal(unpermute_qk(gguf_rows, 1), hf_rows)


def test_unpermute_two_heads_by_hand():
    gguf_rows = np.array(list("acbdegfh"))[:, None]
    assert unpermute_qk(gguf_rows, 2)[:, 0].tolist() == list("abcdefgh")
    weight = torch.arange(8 * 3).reshape(8, 3)
    assert torch.equal(
        unpermute_qk(torch.from_numpy(llama_cpp_permute(weight.numpy(), 2)), 2), weight
    )


def test_unpermute_rejects_odd_head_dim():
    with pytest.raises(ModelFileError):
        unpermute_qk(np.zeros((6, 2)), 2)


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.12.attn_output.weight", "model.layers.12.self_attn.o_proj.weight"),
        ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
        ("rope_freqs.weight", None),
    ],
)
def test_tensor_names(gguf_name, hf_name):
    assert hf_from_gguf_name(gguf_name) == hf_name


def test_tiny_model_round_trips_through_gguf(tiny_gguf_path, tiny_model):
    lm = load_model(tiny_gguf_path, dtype=torch.float32)
    assert lm.config == tiny_model.config
    assert lm.source["format"] == "gguf" and len(lm.source["sha256"]) == 64
    assert lm.state_dict.keys() == tiny_model.state_dict.keys()
    for name, tensor in tiny_model.state_dict.items():
        assert torch.equal(lm.state_dict[name], tensor), name
    text = "<|im_start|>user\nThe capital of France? 東京 😀<|im_end|>"
    assert lm.tokenizer.encode(text) == tiny_model.tokenizer.encode(text)
    assert lm.tokenizer.eos_token_ids == (2, 0)
    assert lm.tokenizer.chat_template == tiny_model.tokenizer.chat_template
    assert load_tokenizer(str(tiny_gguf_path)).encode(text) == tiny_model.tokenizer.encode(text)


def test_truncated_gguf_is_one_sentence(tiny_gguf_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf_path.read_bytes()[:5000])
    with pytest.raises(ModelFileError, match="truncated or malformed"):
        load_model(cut)


def test_gguf_without_llama_keys_is_refused(tmp_path):
    path = _write(tmp_path / "x.gguf", {"w": (np.zeros((2, 2), np.float32), None)})
    with pytest.raises(ModelFileError, match="lacks the metadata key 'llama.attention.head_count'"):
        load_model(path)


def test_non_llama_architecture_is_refused(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="architecture 'gpt2' is not supported"):
        load_model(tmp_path / "g.gguf")


@pytest.mark.slow
def test_smollm2_loads_with_the_documented_config(smollm2_path):
    lm = load_model("smollm2-135m", dtype=torch.bfloat16)
    cfg = lm.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (49152, 576, 1536)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in lm.state_dict
    assert lm.source["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert lm.source["path"] == str(smollm2_path)
    assert sum(t.numel() for t in lm.state_dict.values()) == 134_515_008
    assert all(t.dtype == torch.bfloat16 for t in lm.state_dict.values())


@pytest.mark.slow
def test_smollm2_weights_match_transformers_gguf_conversion(smollm2_path):
    """transformers' own GGUF reader (its own name mapping and reverse permutation)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = load_model(smollm2_path, dtype=torch.float32)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
            )
        )  # fmt: skip
    theirs = load_gguf_checkpoint(str(smollm2_path), return_tensors=True, model_to_load=skeleton)[
        "tensors"
    ]
    assert theirs.keys() == ours.state_dict.keys()
    for name, tensor in ours.state_dict.items():
        assert torch.equal(theirs[name].float(), tensor), name
