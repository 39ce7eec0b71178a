"""Grammar-constrained decoding through `LLMEngine.step` on tiny-random: sampled outputs
validate against their JSON schema, regexes and choices hold, speculation changes no greedy
output and leaves the grammar exactly where a run without the rejected drafts would be, and
the tokenizer's vocabulary reaches the library as the bytes each token decodes to."""

from __future__ import annotations

import json
import re

import pytest
import torch
from grammar_marks import requires_grammar
from test_engine import drain

from engine_ref import EngineConfig, EngineError, LLMEngine, SamplingParams
from engine_ref.core.engine_config import SpeculativeConfig
from engine_ref.core.grammar import (
    GrammarBackend,
    GrammarError,
    GuidedDecoding,
    check_guided,
    token_bytes,
)
from engine_ref.loading.weights import load_tokenizer

pytestmark = requires_grammar
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["hello world " * (i % 5 + 1) for i in range(10)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": None,
         "disable_below_acceptance_rate": 0.0}  # fmt: skip


def make(tiny_model, spec: dict | None = None) -> LLMEngine:
    config = EngineConfig(
        model="tiny-random",
        dtype="float32",
        device="cpu",
        num_blocks=512,
        speculative_config=None if spec is None else SpeculativeConfig(**spec),
    )
    return LLMEngine(config, loaded=tiny_model)


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> dict:
    tok = engine.tokenizer
    for i, text in enumerate(prompts):
        engine.add_request(str(i), tok.encode(text), params)
    return drain(engine)


def guided_json(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=200, guided=GuidedDecoding.json_schema(SCHEMA), **extra)


def test_fifty_sampled_outputs_validate_against_the_schema(tiny_model):
    out = run(make(tiny_model), [PROMPTS[i % 10] for i in range(50)], guided_json(temperature=1.0))
    assert len(out) == 50
    for result in out.values():
        assert result[0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(result[0]["text"]), SCHEMA)
    # Sampling at temperature 1 varies: not one fixed output.
    assert len({r[0]["text"] for r in out.values()}) > 5


def test_unconstrained_outputs_of_the_same_prompts_are_not_json(tiny_model):
    """The check above can fail: without the grammar tiny-random writes no valid JSON."""
    out = run(make(tiny_model), PROMPTS[:5], SamplingParams(max_tokens=20, temperature=1.0))
    for result in out.values():
        with pytest.raises(ValueError):
            jsonschema.validate(json.loads(result[0]["text"]), SCHEMA)


@pytest.mark.parametrize("branches", [1, 2])
def test_speculation_keeps_greedy_outputs_and_validity(tiny_model, branches):
    plain = run(make(tiny_model), PROMPTS, guided_json(temperature=0))
    spec = make(tiny_model, {**NGRAM, "num_tree_branches": branches})
    speculated = run(spec, PROMPTS, guided_json(temperature=0))
    stats = spec.stats().spec_decode
    assert speculated == plain
    # Drafts were both accepted and rejected under the masks.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for result in speculated.values():
        jsonschema.validate(json.loads(result[0]["text"]), SCHEMA)


def test_speculation_with_sampling_validates(tiny_model):
    engine = make(tiny_model, NGRAM)
    out = run(engine, PROMPTS * 2, guided_json(temperature=1.0, seed=3))
    assert engine.stats().spec_decode.num_draft_tokens > 0
    for result in out.values():
        jsonschema.validate(json.loads(result[0]["text"]), SCHEMA)


def _mask(matcher, backend: GrammarBackend) -> list[int]:
    bitmask = backend.allocate(1)
    matcher.fill(bitmask, 0)
    return bitmask[0].tolist()


def test_grammar_state_after_rejected_drafts_equals_a_run_without_them(tiny_model):
    """After every step, each constrained sequence's matcher equals one fed only its
    committed output tokens (parser state and next mask), across steps that rejected drafts."""
    engine = make(tiny_model, NGRAM)
    tok = engine.tokenizer
    for i, text in enumerate(PROMPTS):
        engine.add_request(str(i), tok.encode(text), guided_json(temperature=0))
    backend = GrammarBackend(tok, engine.model_config.vocab_size, tok.eos_token_ids)
    compared = rejecting_steps = 0
    while engine.has_unfinished():
        before = engine.stats().spec_decode
        running = [s for r in engine.requests.values() for s in r.sequences]
        engine.step()
        after = engine.stats().spec_decode
        drafted = after.num_draft_tokens - before.num_draft_tokens
        rejected = drafted - (after.num_accepted_tokens - before.num_accepted_tokens)
        rejecting_steps += rejected > 0
        for seq in running:
            if seq.is_finished or rejected == 0:
                continue
            fresh = backend.matcher(seq.request.params.guided)
            for token in seq.output_token_ids:
                fresh.accept(token)
            assert seq.grammar.debug_state() == fresh.debug_state()
            assert _mask(seq.grammar, backend) == _mask(fresh, backend)
            compared += 1
    assert rejecting_steps > 0 and compared > 0


def test_draft_masks_leave_the_matcher_unchanged_and_mask_each_position(tiny_model):
    engine = make(tiny_model)
    tok = engine.tokenizer
    backend = GrammarBackend(tok, engine.model_config.vocab_size, tok.eos_token_ids)
    guided = GuidedDecoding("regex", "ab+c")
    matcher = backend.matcher(guided)
    a, b, c = (tok.token_to_id(x) for x in "abc")
    bitmask = backend.allocate(4)
    matcher.draft_masks(bitmask, 0, [a, b, a])  # the last drafted token breaks the grammar
    expected = []
    for prefix in ([], [a], [a, b]):
        m = backend.matcher(guided)
        for t in prefix:
            m.accept(t)
        expected.append(_mask(m, backend))
    assert bitmask[:3].tolist() == expected
    assert bitmask[3].tolist() == [-1] * bitmask.shape[1]  # after "aba": never reached
    assert matcher.debug_state() == backend.matcher(guided).debug_state()
    matcher.accept(a)
    with pytest.raises(GrammarError, match="not allowed"):
        matcher.accept(c)


@pytest.mark.parametrize(
    "guided, valid",
    [
        (GuidedDecoding("regex", r"[a-z]{2,6}@(example|test)\.org"),
         lambda t: re.fullmatch(r"[a-z]{2,6}@(example|test)\.org", t)),
        (GuidedDecoding("choice", choices=("yes", "no", 'say "maybe"', "東京")),
         lambda t: t in ("yes", "no", 'say "maybe"', "東京")),
        (GuidedDecoding("grammar", 'root ::= "(" num ("+" num)? ")"\nnum ::= [0-9] [0-9]?'),
         lambda t: re.fullmatch(r"\(\d\d?(\+\d\d?)?\)", t)),
        (GuidedDecoding("json_object"), lambda t: isinstance(json.loads(t), dict)),
    ],
)  # fmt: skip
def test_regex_choice_grammar_and_json_object(tiny_model, guided, valid):
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=11, n=3, guided=guided)
    out = run(make(tiny_model), PROMPTS[:6], params)
    finished = [s for r in out.values() for s in r.values() if s["finish_reason"] == "stop"]
    assert len(finished) >= 12  # json_object may run past max_tokens; the others never do
    for sample in finished:
        assert valid(sample["text"]), sample["text"]


def test_ignore_eos_still_stops_when_the_grammar_is_complete(tiny_model):
    guided = GuidedDecoding("choice", choices=("yes", "no"))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, guided=guided)
    out = run(make(tiny_model), PROMPTS[:2], params)
    for result in out.values():
        assert result[0]["finish_reason"] == "stop" and result[0]["text"] in ("yes", "no")
        assert result[0]["tokens"][-1] in tiny_model.tokenizer.eos_token_ids


def test_an_invalid_grammar_is_an_engine_error(tiny_model):
    engine = make(tiny_model)
    with pytest.raises(EngineError, match="regular expression cannot be used"):
        engine.add_request("a", [5, 6], SamplingParams(guided=GuidedDecoding("regex", "(ab")))
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "guided, message",
    [
        (GuidedDecoding("json", '{"type": "foo"}'), 'JSON schema .*Unsupported type "foo"'),
        (GuidedDecoding("json", "{not json"), "JSON schema .*Failed to parse JSON"),
        (GuidedDecoding("regex", "[a-"), r"regular expression .*Unclosed '\['"),
        (GuidedDecoding("grammar", "root ::= foo"), 'grammar .*Rule "foo" is not defined'),
    ],
)
def test_check_guided_names_the_problem_in_one_sentence(guided, message):
    with pytest.raises(GrammarError, match=message) as info:
        check_guided(guided)
    text = str(info.value)
    assert text.endswith(".") and "\n" not in text and ".cc:" not in text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": "xml"}, "Unknown guided decoding kind"),
        ({"kind": "regex"}, "must not be empty"),
        ({"kind": "choice", "choices": ()}, "non-empty list"),
        ({"kind": "choice", "choices": ("a", "")}, "non-empty list"),
        ({"kind": "regex", "spec": "a" * 65_537}, "65537 characters; at most 65536"),
    ],
)
def test_guided_decoding_fields_are_checked(kwargs, message):
    with pytest.raises(GrammarError, match=message):
        GuidedDecoding(**kwargs)
    GuidedDecoding("regex", "a" * 65_536)  # at the bound


def _check_vocabulary(tokenizer, vocab_size: int) -> None:
    """Every token's bytes are what the tokenizer decodes it to; specials are empty."""
    vocab = token_bytes(tokenizer, vocab_size)
    assert len(vocab) == vocab_size
    checked = 0
    for token_id, raw in enumerate(vocab[: tokenizer.vocab_size]):
        if token_id in tokenizer.special_token_ids:
            assert raw == b""
            continue
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            assert raw == text.encode("utf-8"), token_id
            checked += 1
        else:  # part of a UTF-8 character: decodes to U+FFFD, as its bytes do
            assert raw.decode("utf-8", errors="replace") == text, token_id
        assert raw
    assert checked > 0.7 * tokenizer.vocab_size
    assert all(raw == b"" for raw in vocab[tokenizer.vocab_size :])


def test_tiny_random_vocabulary_as_bytes(tiny_tokenizer):
    _check_vocabulary(tiny_tokenizer, tiny_tokenizer.vocab_size + 7)  # padded logits too
    partial = [t for t in range(tiny_tokenizer.vocab_size) if t > 2 and len(token_bytes(
        tiny_tokenizer)[t]) == 1 and token_bytes(tiny_tokenizer)[t][0] >= 0x80]  # fmt: skip
    assert partial  # bytes of multi-byte characters are tokens of their own


def test_smollm2_vocabulary_as_bytes(smollm2_path):
    tokenizer = load_tokenizer("smollm2-135m")
    _check_vocabulary(tokenizer, tokenizer.vocab_size)


def test_a_tokenizer_that_is_not_byte_level_is_refused(tiny_tokenizer):
    from tokenizers import decoders

    backend = tiny_tokenizer.backend.__class__.from_str(tiny_tokenizer.backend.to_str())
    backend.decoder = decoders.Metaspace()
    other = type(tiny_tokenizer)(backend, name="spm-like", eos_token_ids=(2,))
    with pytest.raises(GrammarError, match="byte-level BPE"):
        token_bytes(other)


def test_masks_never_allow_special_tokens_but_end_of_sequence(tiny_model):
    tok = tiny_model.tokenizer
    backend = GrammarBackend(tok, tiny_model.config.vocab_size, tok.eos_token_ids)
    matcher = backend.matcher(GuidedDecoding("regex", "a*"))
    logits = torch.zeros(1, tiny_model.config.vocab_size)
    bitmask = backend.allocate(1)
    matcher.fill(bitmask, 0)
    backend.apply(logits, bitmask, [0])
    allowed = set(torch.nonzero(logits[0] == 0).flatten().tolist())
    assert set(tok.eos_token_ids) <= allowed  # "a*" may end at once
    assert not (set(tok.special_token_ids) - set(tok.eos_token_ids)) & allowed
    assert all(set(tok.decode([t])) <= {"a"} for t in allowed - set(tok.eos_token_ids))
