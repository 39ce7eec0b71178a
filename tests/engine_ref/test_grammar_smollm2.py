"""Guided decoding on SmolLM2-135M-Instruct (slow: needs the model file): 50 chat requests
sampled at temperature 1 under a JSON schema all validate, and with n-gram speculation on the
greedy outputs are those without it (and validate)."""

from __future__ import annotations

import json

import pytest
from grammar_marks import requires_grammar
from test_engine import drain

from engine_ref import EngineConfig, LLMEngine, SamplingParams
from engine_ref.core.grammar import GuidedDecoding
from engine_ref.loading.weights import load_model

pytestmark = requires_grammar
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Tokyo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
QUESTIONS = ["Describe a person as JSON.", "Give me a JSON record of a traveller.",
             "Make up a user profile in JSON.", "Who lives in Rome? Answer in JSON.",
             "Invent a scientist and give their record as JSON."]  # fmt: skip
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": None, "disable_below_acceptance_rate": 0.0}  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2_path):
    return load_model("smollm2-135m", dtype="float32")


def _run(loaded, params: SamplingParams, count: int, spec: dict | None = None):
    config = EngineConfig(model="smollm2-135m", dtype="float32", device="cpu",
                          kv_cache_memory_bytes=64 << 20, speculative_config=spec)  # fmt: skip
    engine = LLMEngine(config, loaded=loaded)
    tok = loaded.tokenizer
    for i in range(count):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        engine.add_request(str(i), tok.encode(tok.apply_chat_template(messages)), params)
    return drain(engine), engine


def test_fifty_sampled_outputs_validate_on_smollm2(smollm2_loaded):
    guided = GuidedDecoding.json_schema(SCHEMA)
    # Room for the longest record the schema allows: 8 name characters of up to 4 UTF-8
    # bytes each can take 32 byte-level tokens (a sampled katakana name took 6 characters
    # and most of 40 tokens), the rest about 20.
    params = SamplingParams(max_tokens=64, temperature=1.0, guided=guided)
    out, _ = _run(smollm2_loaded, params, 50)
    assert len(out) == 50
    for result in out.values():
        assert result[0]["finish_reason"] == "stop", result[0]["text"]
        jsonschema.validate(json.loads(result[0]["text"]), SCHEMA)
    assert len({r[0]["text"] for r in out.values()}) > 10


def test_speculation_keeps_greedy_guided_outputs_on_smollm2(smollm2_loaded):
    params = SamplingParams(max_tokens=40, temperature=0, guided=GuidedDecoding.json_schema(SCHEMA))
    plain, _ = _run(smollm2_loaded, params, 5)
    speculated, engine = _run(smollm2_loaded, params, 5, SPEC)
    assert speculated == plain
    assert engine.stats().spec_decode.num_draft_tokens > 0
    for result in plain.values():
        jsonschema.validate(json.loads(result[0]["text"]), SCHEMA)
