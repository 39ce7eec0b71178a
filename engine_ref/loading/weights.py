"""Public entry for model files: `load_model` and `load_tokenizer`.

```python
from engine_ref.loading.weights import load_model
lm = load_model("smollm2-135m", dtype=torch.bfloat16, device="cpu")
lm.config, lm.state_dict, lm.tokenizer, lm.source
```
`state_dict` uses Hugging Face Llama names (`model.layers.{i}.self_attn.q_proj.weight`, ...),
with Q/K rows in Hugging Face (rotate_half) order; `lm_head.weight` is present only when the
output projection is not tied to the embedding.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_ref.core.config import ModelConfig
from engine_ref.core.quant import Int4Groups
from engine_ref.loading.model_files import ModelFileError, ResolvedModel, resolve_model, sha256_of
from engine_ref.loading.tokenizer import Tokenizer
from engine_ref.loading.tokenizer_files import load_tokenizer  # noqa: F401  (its old home)

__all__ = ["LoadedModel", "ModelFileError", "load_model", "load_tokenizer", "parse_dtype"]

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine: hyper-parameters, weights, tokenizer and provenance.

    `source` holds `name`, `path` (str or None), `format` ("gguf" | "hf" | "random"),
    `sha256` (of the GGUF file; absent for directories and in-process models), `dtype`,
    `load_s` (wall seconds spent in `load_model`). `int4_weights` holds the file's Q4_0/Q4_1
    matrices as stored (HF names), when `load_model` was asked to keep them."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor] = field(repr=False)
    tokenizer: Tokenizer
    source: dict[str, Any]
    int4_weights: dict[str, Int4Groups] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        missing = [n for n in expected_weight_names(self.config) if n not in self.state_dict]
        if missing:
            raise ModelFileError(
                f"Model {self.source.get('name')!r} lacks {len(missing)} weights, e.g. {missing[0]!r}."
            )


def expected_weight_names(config: ModelConfig) -> list[str]:
    """The state-dict keys a Llama model with `config` must have, in a stable order."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept a torch floating dtype or one of its names ("bfloat16", "float32", "fp16", ...)."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ModelFileError(f"dtype {dtype} is not a floating-point type.")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ModelFileError(f"Unknown dtype {dtype!r}; use one of bfloat16, float16, float32.")
    return _DTYPES[key]


def load_model(
    name_or_path: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.bfloat16,
    device: str | torch.device = "cpu",
    *,
    keep_int4: bool = False,
) -> LoadedModel:
    """Load weights, config and tokenizer for a registered name, a `.gguf` file or a Hugging
    Face directory. Quantised GGUF tensors are dequantised to `dtype`; with `keep_int4` the
    Q4_0/Q4_1 ones are also kept as stored (`LoadedModel.int4_weights`). Registered models are
    fetched into the cache on first use. Raises `ModelFileError` (one sentence) on bad input."""
    t0 = time.perf_counter()
    torch_dtype = parse_dtype(dtype)
    resolved = resolve_model(name_or_path)
    int4_weights: dict[str, Int4Groups] = {}
    if resolved.format == "random":
        from engine_ref.loading import tiny_random

        tokenizer = tiny_random.build_tiny_tokenizer()
        config = tiny_random.tiny_random_config(tokenizer.vocab_size)
        state_dict = tiny_random.tiny_random_state_dict(config, dtype=torch_dtype)
    elif resolved.format == "gguf":
        from engine_ref.loading import gguf_loader

        config, state_dict, tokenizer = gguf_loader.load_gguf(
            resolved.path,
            dtype=torch_dtype,
            name=resolved.name,
            int4_weights=int4_weights if keep_int4 else None,
        )
    else:
        from engine_ref.loading import hf_loader

        config, state_dict, tokenizer = hf_loader.load_hf_dir(
            resolved.path, dtype=torch_dtype, name=resolved.name
        )
    device = torch.device(device)
    if device.type != "cpu":
        state_dict = {k: v.to(device) for k, v in state_dict.items()}
    source = _source(resolved, torch_dtype)
    source["load_s"] = round(time.perf_counter() - t0, 3)
    return LoadedModel(
        config=config,
        state_dict=state_dict,
        tokenizer=tokenizer,
        source=source,
        int4_weights=int4_weights,
    )


def _source(resolved: ResolvedModel, dtype: torch.dtype) -> dict[str, Any]:
    source: dict[str, Any] = {
        "name": resolved.name,
        "path": None if resolved.path is None else str(resolved.path),
        "format": resolved.format,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if resolved.format == "gguf" and resolved.path is not None:
        source["sha256"] = sha256_of(resolved.path)
    return source
