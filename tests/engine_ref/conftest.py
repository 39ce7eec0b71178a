"""Shared fixtures for the reference engine's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_writer_util import write_llama_gguf

from engine_ref.loading.tiny_random import build_tiny_tokenizer
from engine_ref.loading.tokenizer import Tokenizer
from engine_ref.loading.weights import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """tiny-random in float32 (shared: tests must not modify its tensors)."""
    return load_model("tiny-random", dtype="float32")


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory, tiny_model) -> Path:
    """tiny-random written as an F32 llama GGUF file (permuted Q/K, as llama.cpp would)."""
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_model)
