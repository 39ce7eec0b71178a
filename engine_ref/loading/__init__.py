"""Model files: GGUF and Hugging Face readers, weights, tokenizer, the model registry and fetch,
export, and the tiny-random model; and `build.py`, which loads the model an `EngineConfig` names
and builds the engine over it (`engine_ref.build_engine`; the core itself loads nothing).

The one entry point for code outside `engine_ref` (the harness, workloads, benchmarks):

    from engine_ref.loading import load_model, load_tokenizer, ModelFileError

`load_tokenizer(name_or_path)` takes a reference model name (`smollm2-135m`, `tiny-random`), a
GGUF file or a Hugging Face directory and returns a tokenizer without loading any weights.

`load_model` and `LoadedModel` (torch) load on first use; the rest imports without torch.
"""

from __future__ import annotations

from engine_ref.loading.model_files import ModelFileError
from engine_ref.loading.tokenizer_files import load_tokenizer

__all__ = ["LoadedModel", "ModelFileError", "load_model", "load_tokenizer"]


def __getattr__(name: str):
    if name in ("LoadedModel", "load_model"):
        from engine_ref.loading import weights

        value = getattr(weights, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'engine_ref.loading' has no attribute {name!r}")
