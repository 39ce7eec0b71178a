"""Export the weights and tokenizer the engine runs as a Hugging Face Llama directory, so other
engines (transformers, vLLM, ...) can be benchmarked on exactly the same model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from engine_ref.loading.model_files import ModelFileError
from engine_ref.loading.weights import LoadedModel, load_model, parse_dtype

EXPORTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def hf_config_dict(lm: LoadedModel, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for `LlamaForCausalLM` describing `lm`."""
    cfg = lm.config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _tokenizer_files(lm: LoadedModel) -> dict[str, dict[str, Any]]:
    tok = lm.tokenizer
    bos, eos = tok.bos_token, tok.eos_token
    pad = eos
    specials = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    specials = {k: v for k, v in specials.items() if v is not None}
    additional = sorted(
        (
            t
            for t in (tok.id_to_token(i) for i in tok.special_token_ids)
            if t not in specials.values()
        ),
        key=lambda t: tok.token_to_id(t) or 0,
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "additional_special_tokens": additional,
        "chat_template": tok.chat_template or None,
        "model_max_length": lm.config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    generation_config = {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": list(tok.eos_token_ids),
        "pad_token_id": tok.eos_token_ids[0] if tok.eos_token_ids else None,
    }
    return {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": {**specials, "additional_special_tokens": additional},
        "generation_config.json": generation_config,
    }


def export_hf(
    name_or_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.bfloat16,
) -> Path:
    """Write `name_or_path` (as `load_model` resolves it) to `out_dir` as a Hugging Face Llama
    directory: config.json, model.safetensors (the state dict the engine runs, in `dtype`, tied
    embeddings stored once), tokenizer.json, tokenizer_config.json, special_tokens_map.json,
    generation_config.json. `out_dir` may exist but must not contain any of those files.
    Returns `out_dir`. Raises `ModelFileError` on bad input."""
    from safetensors.torch import save_file

    torch_dtype = parse_dtype(dtype)
    out = Path(out_dir)
    clashes = [name for name in EXPORTED_FILES if (out / name).exists()]
    if clashes:
        raise ModelFileError(
            f"Export directory {str(out)!r} already holds {clashes[0]}; choose an empty directory."
        )
    lm = load_model(name_or_path, dtype=torch_dtype, device="cpu")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in lm.state_dict.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    lm.tokenizer.backend.save(str(out / "tokenizer.json"))
    files = {"config.json": hf_config_dict(lm, torch_dtype), **_tokenizer_files(lm)}
    for name, content in files.items():
        (out / name).write_text(
            json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
    return out
