"""Load a Hugging Face Llama directory: config.json, *.safetensors, tokenizer.json and the
chat template from tokenizer_config.json (or chat_template.jinja)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

from engine_ref.core.config import ModelConfig
from engine_ref.loading.model_files import ModelFileError
from engine_ref.loading.tokenizer import Tokenizer, eos_ids_for

if TYPE_CHECKING:  # only weights need torch; a tokenizer loads without it
    import torch

_SUPPORTED_MODEL_TYPES = ("llama",)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelFileError(f"Model directory {str(path.parent)!r} has no {path.name}.")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{str(path)!r} is not valid JSON ({exc}).") from exc


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a config.json dict; raises `ModelFileError` for what the engine's
    Llama forward pass cannot run (other architectures, biases, RoPE scaling, odd head_dim)."""
    model_type = raw.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise ModelFileError(f"Model type {model_type!r} is not supported; only 'llama' is.")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ModelFileError("Llama models with attention or MLP biases are not supported.")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelFileError(f"Activation {raw['hidden_act']!r} is not supported; only 'silu' is.")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ModelFileError(f"RoPE scaling {rope_type!r} is not supported.")
    try:
        heads = int(raw["num_attention_heads"])
        eos = _as_id_list(raw.get("eos_token_id"))
        config = ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos[0] if eos else None,
        )
    except KeyError as exc:
        raise ModelFileError(f"config.json lacks the key {exc.args[0]!r}.") from exc
    except ValueError as exc:
        raise ModelFileError(f"config.json is inconsistent: {exc}.") from exc
    head_dim = raw.get("head_dim")
    if head_dim is not None and int(head_dim) != config.head_dim:
        raise ModelFileError(f"head_dim {head_dim} differs from hidden_size / num_attention_heads.")
    return config


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map", {})
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"Model directory {str(directory)!r} has no *.safetensors weights.")
    return files


def load_hf_state_dict(
    directory: Path, config: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state_dict: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(directory):
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"Cannot read weights {str(path)!r} ({exc}).") from exc
        for name, tensor in tensors.items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            state_dict[name] = tensor.to(dtype)
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    return state_dict


def _token_string(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template") or ""
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template", "") for t in template}
        template = named.get("default") or next(iter(named.values()), "")
    return template


def load_hf_tokenizer(directory: Path, *, name: str) -> Tokenizer:
    """The tokenizer of a Hugging Face directory (tokenizer.json is required)."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelFileError(f"Model directory {str(directory)!r} has no tokenizer.json.")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception
        raise ModelFileError(f"Cannot read {str(path)!r} ({exc}).") from exc
    tok_config = _read_json(directory / "tokenizer_config.json", required=False)
    model_config = _read_json(directory / "config.json", required=False)
    gen_config = _read_json(directory / "generation_config.json", required=False)
    bos = _token_string(tok_config.get("bos_token"))
    eos = _token_string(tok_config.get("eos_token"))
    eos_ids: list[int | None] = [backend.token_to_id(eos)] if eos else []
    eos_ids += _as_id_list(model_config.get("eos_token_id"))
    eos_ids += _as_id_list(gen_config.get("eos_token_id"))
    bos_id = backend.token_to_id(bos) if bos else model_config.get("bos_token_id")
    return Tokenizer(
        backend,
        name=name,
        chat_template=_chat_template(directory, tok_config),
        eos_token_ids=eos_ids_for(backend, eos_ids),
        bos_token_id=bos_id,
    )


def load_hf_dir(
    directory: Path, *, dtype: torch.dtype, name: str
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    config = config_from_hf(_read_json(directory / "config.json", required=True))
    return (
        config,
        load_hf_state_dict(directory, config, dtype),
        load_hf_tokenizer(directory, name=name),
    )
