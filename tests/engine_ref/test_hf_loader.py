import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_ref.loading.hf_loader import config_from_hf
from engine_ref.loading.model_files import ModelFileError
from engine_ref.loading.weights import load_model, load_tokenizer

BASE = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture
def hf_dir(tmp_path, tiny_model):
    from engine_ref.loading.export import export_hf

    return export_hf("tiny-random", tmp_path / "m", dtype="float32")


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_config_defaults_follow_llama_config():
    cfg = config_from_hf(BASE)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (10000.0, 1e-6, 2048)
    assert cfg.tie_word_embeddings is False  # LlamaConfig's default
    assert config_from_hf({**BASE, "num_key_value_heads": None}).num_key_value_heads == 4
    assert config_from_hf({**BASE, "eos_token_id": [7, 8]}).eos_token_id == 7
    assert (
        config_from_hf(
            {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
        ).rope_theta
        == 5e5
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "qwen2"}, "Model type 'qwen2' is not supported"),
        ({"attention_bias": True}, "biases are not supported"),
        ({"hidden_act": "gelu"}, "Activation 'gelu'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3'"),
        ({"head_dim": 32}, "head_dim 32 differs"),
        ({"num_attention_heads": 5}, "inconsistent"),
    ],
)
def test_unsupported_configs(changes, message):
    with pytest.raises(ModelFileError, match=message):
        config_from_hf({**BASE, **changes})


def test_missing_config_key():
    config = dict(BASE)
    del config["hidden_size"]
    with pytest.raises(ModelFileError, match="lacks the key 'hidden_size'"):
        config_from_hf(config)


def test_sharded_weights_and_untied_head(hf_dir, tiny_model):
    weights = load_file(hf_dir / "model.safetensors")
    (hf_dir / "model.safetensors").unlink()
    names = sorted(weights)
    half = len(names) // 2
    lm_head = torch.full((512, 64), 0.5)
    save_file({n: weights[n] for n in names[:half]}, hf_dir / "model-00001-of-00002.safetensors")
    save_file(
        {**{n: weights[n] for n in names[half:]}, "lm_head.weight": lm_head},
        hf_dir / "model-00002-of-00002.safetensors",
    )
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names[:half]}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in [*names[half:], "lm_head.weight"]}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _edit_config(hf_dir, tie_word_embeddings=False)
    lm = load_model(hf_dir, dtype=torch.float32)
    assert lm.config.tie_word_embeddings is False
    assert torch.equal(lm.state_dict["lm_head.weight"], lm_head)
    assert torch.equal(
        lm.state_dict["model.layers.2.mlp.up_proj.weight"],
        tiny_model.state_dict["model.layers.2.mlp.up_proj.weight"],
    )


def test_tied_config_drops_a_stored_lm_head(hf_dir):
    weights = load_file(hf_dir / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, hf_dir / "model.safetensors")
    sd = load_model(hf_dir).state_dict
    assert "lm_head.weight" not in sd and not any("inv_freq" in n for n in sd)


def test_untied_without_lm_head_is_refused(hf_dir):
    _edit_config(hf_dir, tie_word_embeddings=False)
    with pytest.raises(ModelFileError, match="lacks 1 weights, e.g. 'lm_head.weight'"):
        load_model(hf_dir)


def test_chat_template_jinja_file_and_named_templates(hf_dir):
    tok_config_path = hf_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    tok_config_path.write_text(json.dumps(tok_config))
    assert load_tokenizer(hf_dir).chat_template == "D"
    (hf_dir / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_tokenizer(hf_dir).apply_chat_template([{"role": "user", "content": "x"}]) == "J1"


@pytest.mark.parametrize("missing", ["tokenizer.json", "model.safetensors"])
def test_missing_files(hf_dir, missing):
    (hf_dir / missing).unlink()
    with pytest.raises(
        ModelFileError,
        match=f"has no {'tokenizer.json' if missing == 'tokenizer.json' else '[*].safetensors'}",
    ):
        load_model(hf_dir)


def test_corrupt_files(hf_dir, tmp_path):
    (hf_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="is not valid JSON"):
        load_model(hf_dir)
    other = shutil.copytree(hf_dir, tmp_path / "other")
    (other / "config.json").write_text(json.dumps(BASE | {"tie_word_embeddings": True}))
    (other / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelFileError, match="Cannot read weights"):
        load_model(other)
