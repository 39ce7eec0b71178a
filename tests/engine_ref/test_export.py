import json

import pytest
import torch
from click.testing import CliRunner

from engine_ref.loading.export import export_hf
from engine_ref.loading.model_files import ModelFileError
from engine_ref.loading.weights import load_model
from engine_ref.serving.cli_model import model as model_cli


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    return export_hf("tiny-random", tmp_path_factory.mktemp("export") / "tiny", dtype="float32")


def test_export_writes_the_hf_files(tiny_export):
    assert sorted(p.name for p in tiny_export.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((tiny_export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (64, 2, 16)
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    tok_config = json.loads((tiny_export / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["eos_token"] == "<|im_end|>" and "bos_token" not in tok_config
    assert tok_config["chat_template"].startswith("{% for message in messages %}")
    assert json.loads((tiny_export / "generation_config.json").read_text())["eos_token_id"] == [
        2,
        0,
    ]


def test_export_round_trips_through_the_hf_loader(tiny_export, tiny_model):
    lm = load_model(tiny_export, dtype=torch.float32)
    assert lm.config == tiny_model.config
    assert lm.source["format"] == "hf"
    assert lm.state_dict.keys() == tiny_model.state_dict.keys()
    for name, tensor in tiny_model.state_dict.items():
        assert torch.equal(lm.state_dict[name], tensor), name
    assert lm.tokenizer.eos_token_ids == (2, 0)
    messages = [{"role": "user", "content": "Hi"}]
    assert lm.tokenizer.apply_chat_template(messages) == tiny_model.tokenizer.apply_chat_template(
        messages
    )


def test_transformers_reads_the_export(tiny_export, tiny_model):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf_model = LlamaForCausalLM.from_pretrained(tiny_export, dtype=torch.float32)
    assert torch.equal(hf_model.lm_head.weight, tiny_model.state_dict["model.embed_tokens.weight"])
    hf_sd = hf_model.state_dict()
    for name, tensor in tiny_model.state_dict.items():
        assert torch.equal(hf_sd[name], tensor), name
    assert "lm_head.weight" not in load_file(tiny_export / "model.safetensors")  # tied: stored once
    hf_tok = AutoTokenizer.from_pretrained(tiny_export)
    text = "<|im_start|>user\nWhat is the capital of France? 42 東京<|im_end|>"
    assert hf_tok.encode(text, add_special_tokens=False) == tiny_model.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == tiny_model.tokenizer.apply_chat_template(messages)


def test_export_refuses_to_overwrite(tiny_export):
    with pytest.raises(ModelFileError, match="already holds config.json"):
        export_hf("tiny-random", tiny_export)


def test_cli_export_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_CACHE_DIR", str(tmp_path / "cache"))
    runner = CliRunner()
    result = runner.invoke(
        model_cli, ["export", "tiny-random", "--format", "hf", str(tmp_path / "out")]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    result = runner.invoke(model_cli, ["export", "nonsense-model", str(tmp_path / "out2")])
    assert result.exit_code == 2
    assert (
        "Unknown model 'nonsense-model'; known models are tiny-random, smollm2-135m"
        in result.output
    )
    assert "Traceback" not in result.output
    result = runner.invoke(model_cli, ["fetch", "tiny-random"])
    assert result.exit_code == 2 and "has no files to fetch" in result.output


def test_cli_list(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_CACHE_DIR", str(tmp_path / "cache"))
    result = CliRunner().invoke(model_cli, ["list"])
    assert result.exit_code == 0
    assert "smollm2-135m (default)" in result.output and "not fetched" in result.output
    assert "tiny-random" in result.output


@pytest.mark.slow
def test_smollm2_export_answers_paris_in_transformers(smollm2_path, tmp_path):
    """Loader, Q/K un-permutation and tokenizer checked end to end by an independent model."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = export_hf("smollm2-135m", tmp_path / "smollm2")
    hf_model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf_tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == load_model(out).tokenizer.apply_chat_template(messages)
    inputs = hf_tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        generated = hf_model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = hf_tok.decode(generated[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "The capital of France is Paris." in answer
