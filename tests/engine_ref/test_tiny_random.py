import pickle
import time

import pytest
import torch

from engine_ref.core.config import ModelConfig
from engine_ref.loading.weights import expected_weight_names, load_model, load_tokenizer


def test_config_is_the_documented_small_llama(tiny_model):
    assert tiny_model.config == ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=2,
    )
    assert tiny_model.config.head_dim == 16
    assert tiny_model.source == {
        "name": "tiny-random",
        "path": None,
        "format": "random",
        "dtype": "float32",
        "load_s": tiny_model.source["load_s"],
    }


def test_state_dict_names_and_shapes(tiny_model):
    sd = tiny_model.state_dict
    assert list(sd) == expected_weight_names(tiny_model.config)
    assert "lm_head.weight" not in sd  # tied
    assert sd["model.embed_tokens.weight"].shape == (512, 64)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert sd["model.layers.3.self_attn.k_proj.weight"].shape == (32, 64)  # 2 kv heads x 16
    assert sd["model.layers.3.self_attn.v_proj.weight"].shape == (32, 64)
    assert sd["model.layers.1.mlp.down_proj.weight"].shape == (64, 128)
    assert sd["model.norm.weight"].shape == (64,)
    assert all(t.dtype == torch.float32 for t in sd.values())


def test_loads_deterministically_and_fast():
    t0 = time.perf_counter()
    a = load_model("tiny-random", dtype=torch.bfloat16)
    elapsed_s = time.perf_counter() - t0
    b = load_model("tiny-random", dtype="bfloat16")
    assert elapsed_s < 1.0
    assert a.state_dict.keys() == b.state_dict.keys()
    for name in a.state_dict:
        assert a.state_dict[name].dtype == torch.bfloat16
        assert torch.equal(a.state_dict[name], b.state_dict[name]), name
    # weights differ between tensors (a seeded generator advancing, not one reused draw)
    q0 = a.state_dict["model.layers.0.self_attn.q_proj.weight"]
    q1 = a.state_dict["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(q0, q1)
    assert a.tokenizer.backend.to_str() == b.tokenizer.backend.to_str()


def test_bf16_is_the_float32_weights_rounded(tiny_model):
    bf16 = load_model("tiny-random", dtype=torch.bfloat16)
    for name, t in tiny_model.state_dict.items():
        assert torch.equal(bf16.state_dict[name], t.to(torch.bfloat16)), name


def test_tokenizer_special_ids_and_round_trip(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.vocab_size == 512
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        0,
        1,
        2,
    ]
    assert tok.eos_token_ids == (2, 0)
    assert tok.special_token_ids == frozenset({0, 1, 2})
    for text in ["Hello, world!", "  two  spaces\nand a newline\t", "Café 東京 😀", "x" * 300, ""]:
        ids = tok.encode(text)
        assert all(0 <= i < 512 for i in ids)
        assert tok.decode(ids) == text
    # byte-level BPE: an unseen character still encodes, one id per UTF-8 byte at worst
    assert tok.decode(tok.encode("ꙮ")) == "ꙮ"
    assert len(tok.encode("ꙮ")) <= len("ꙮ".encode())


def test_tokenizer_special_strings_and_skipping(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    # frequent words from the training text became single tokens
    assert len(tok.encode(" capital")) == 1
    assert tok.convert_ids_to_tokens(tok.encode(" the")) == ["Ġthe"]


def test_chat_template_renders_chatml(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Hi?"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
        "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        add_generation_prompt=False,
    )
    assert no_prompt == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"


def test_tokenizer_pickles(tiny_tokenizer):
    tiny_tokenizer.apply_chat_template([{"role": "user", "content": "x"}])  # compile the template
    clone = pickle.loads(pickle.dumps(tiny_tokenizer))
    assert clone.encode("Hello there") == tiny_tokenizer.encode("Hello there")
    assert clone.eos_token_ids == tiny_tokenizer.eos_token_ids
    assert clone.apply_chat_template([{"role": "user", "content": "x"}]).endswith("assistant\n")


def test_load_tokenizer_matches_load_model(tiny_model):
    tok = load_tokenizer("tiny-random")
    assert tok.backend.to_str() == tiny_model.tokenizer.backend.to_str()


@pytest.mark.parametrize("dtype", ["int8", torch.int32])
def test_bad_dtype_is_a_model_file_error(dtype):
    from engine_ref.loading.model_files import ModelFileError

    with pytest.raises(ModelFileError):
        load_model("tiny-random", dtype=dtype)


@pytest.mark.slow
def test_same_model_in_a_fresh_process(tiny_model):
    """Rust hash maps are seeded per process: training and weights must not depend on them."""
    import hashlib
    import subprocess
    import sys

    script = (
        "import hashlib\n"
        "from engine_ref.loading.weights import load_model\n"
        "lm = load_model('tiny-random', dtype='float32')\n"
        "print(hashlib.sha256(lm.tokenizer.backend.to_str().encode()).hexdigest())\n"
        "print(hashlib.sha256(b''.join(t.numpy().tobytes() for t in lm.state_dict.values())).hexdigest())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    tok_hash, weights_hash = out.stdout.split()
    assert tok_hash == hashlib.sha256(tiny_model.tokenizer.backend.to_str().encode()).hexdigest()
    weights = b"".join(t.numpy().tobytes() for t in tiny_model.state_dict.values())
    assert weights_hash == hashlib.sha256(weights).hexdigest()
