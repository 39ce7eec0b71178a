"""Greedy parity with Hugging Face transformers on SmolLM2-135M (same weights, float32)."""

from __future__ import annotations

import pytest
import torch

from engine_ref import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1492, Christopher Columbus",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from engine_ref.loading.weights import load_model

    return load_model(smollm2_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_model(smollm2):
    transformers = pytest.importorskip("transformers")
    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM

    from engine_ref.loading.export import hf_config_dict

    config = LlamaConfig(**hf_config_dict(smollm2, torch.float32))
    model = LlamaForCausalLM(config).eval()
    state = dict(smollm2.state_dict)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


@pytest.fixture(scope="module")
def engine(smollm2):
    config = EngineConfig(model="smollm2-135m", dtype="float32", device="cpu",
                          max_model_len=512, num_blocks=256, num_threads=2)  # fmt: skip
    return LLMEngine(config, loaded=smollm2)


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, ignore_eos=True):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    tokens: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
            text[out.request_id] = text.get(out.request_id, "") + out.outputs[0].new_text
    return [tokens[f"p{i}"] for i in range(len(prompts))], [
        text[f"p{i}"] for i in range(len(prompts))
    ]


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Plain argmax decoding with transformers' KV cache (no logits processors, so end-of-
    sequence tokens are taken like any other, as the engine does with ignore_eos)."""
    out_tokens: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(new_tokens):
            token = int(out.logits[0, -1].argmax())
            out_tokens.append(token)
            out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return out_tokens


def test_greedy_tokens_match_transformers(engine, hf_model, smollm2):
    tok = smollm2.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    ours, _ = engine_greedy(engine, prompts, NEW_TOKENS)  # all batched together
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf_model, prompt, NEW_TOKENS), tok.decode(prompt)


def test_chat_answer_capital_of_france(engine, smollm2):
    tok = smollm2.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    _, answers = engine_greedy(engine, [tok.encode(text)], 24, ignore_eos=False)
    assert answers[0].strip() == "The capital of France is Paris."
