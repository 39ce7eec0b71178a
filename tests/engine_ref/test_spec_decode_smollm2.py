"""Speculative decoding on SmolLM2-135M-Instruct (slow: needs the model file): greedy outputs
of 8 chat prompts equal those without speculation, and repetition prompts accept drafts."""

from __future__ import annotations

from test_engine import drain

from engine_ref import EngineConfig, LLMEngine, SamplingParams
from engine_ref.loading.weights import load_model

SPEC = '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"disable_by_batch_size":null}'
PROMPTS = [
    "Repeat exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps.",
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "Copy this list: apples, pears, plums, apples, pears, plums.",
    "Tell me a short story about a robot.",
    "Translate to French: good morning, good evening, good night.",
    "List the days of the week.",
    "Say hello three times.",
]


def test_greedy_outputs_equal_without_speculation_on_smollm2(smollm2_path):
    loaded = load_model("smollm2-135m", dtype="float32")
    tok = loaded.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS
    ]
    params = SamplingParams(max_tokens=48, temperature=0)
    results = []
    for spec in (None, SPEC):
        config = EngineConfig(model="smollm2-135m", dtype="float32", device="cpu",
                              kv_cache_memory_bytes=64 << 20, speculative_config=spec)  # fmt: skip
        engine = LLMEngine(config, loaded=loaded)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        results.append(drain(engine))
        stats = engine.stats()
    assert results[0] == results[1]
    assert stats.spec_decode.num_accepted_tokens > 0
    assert stats.num_blocks_used == 0
