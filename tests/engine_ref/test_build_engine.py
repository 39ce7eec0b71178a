"""`engine_ref.build_engine` loads what the config names and builds the engine over it;
`LLMEngine` itself takes models already loaded and says where to go when given none."""

from __future__ import annotations

import pytest
import torch
from greedy_util import greedy_tokens

import engine_ref.loading.build as build
from engine_ref import EngineConfig, EngineError, LLMEngine, build_engine

DRAFT_MODEL = {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 2,
               "disable_by_batch_size": None}  # fmt: skip
PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]


def config(**overrides) -> EngineConfig:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=64,
                   num_threads=1)  # fmt: skip
    return EngineConfig(**(options | overrides))


@pytest.fixture
def loads(tiny_model, monkeypatch) -> list[tuple]:
    """Every `load_model` call the factory makes, each answered with tiny-random."""
    calls = []

    def load_model(name, dtype, keep_int4=False):
        calls.append((name, dtype, keep_int4))
        return tiny_model

    monkeypatch.setattr(build, "load_model", load_model)
    return calls


def test_build_engine_equals_an_engine_over_the_loaded_model(tiny_model):
    built = build_engine(config())
    assert isinstance(built, LLMEngine)
    given = LLMEngine(config(), loaded=tiny_model)
    assert greedy_tokens(built, PROMPTS, 6) == greedy_tokens(given, PROMPTS, 6)


@pytest.mark.parametrize(("quantization", "keep_int4"), [(None, False), ("w4a16", True)])
def test_build_engine_loads_the_configs_model(loads, quantization, keep_int4):
    build_engine(config(quantization=quantization))
    assert loads == [("tiny-random", torch.float32, keep_int4)]


def test_build_engine_loads_a_draft_model_unless_given(tiny_model, loads):
    build_engine(config(speculative_config=DRAFT_MODEL))
    assert loads == [("tiny-random", torch.float32, False), ("tiny-draft", torch.float32, False)]
    loads.clear()
    build_engine(config(speculative_config=DRAFT_MODEL), loaded=tiny_model, draft_loaded=tiny_model)
    assert loads == []


def test_build_engine_checks_cuda_before_loading(loads, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineError, match="CUDA is not available"):
        build_engine(config(device="cuda"))
    assert loads == []


def test_an_engine_without_a_loaded_model_names_the_factory():
    with pytest.raises(EngineError, match=r"engine_ref\.build_engine\(config\)"):
        LLMEngine(config())


def test_a_draft_model_engine_without_the_draft_names_the_factory(tiny_model):
    with pytest.raises(EngineError, match="'tiny-draft' is not loaded.*build_engine"):
        LLMEngine(config(speculative_config=DRAFT_MODEL), loaded=tiny_model)
