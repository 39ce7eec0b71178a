"""A model's tokenizer without its weights, and without torch: the harness counts tokens with
these, so a client process never pays for torch."""

from __future__ import annotations

import os

from engine_ref.loading.model_files import resolve_model
from engine_ref.loading.tokenizer import Tokenizer


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a model without loading its weights (fetches registered models if
    needed). Raises `ModelFileError` on bad input."""
    resolved = resolve_model(name_or_path)
    if resolved.format == "random":
        from engine_ref.loading.tiny_random import build_tiny_tokenizer

        return build_tiny_tokenizer()
    if resolved.format == "gguf":
        from engine_ref.loading.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(resolved.path, name=resolved.name)
    from engine_ref.loading.hf_loader import load_hf_tokenizer

    return load_hf_tokenizer(resolved.path, name=resolved.name)
