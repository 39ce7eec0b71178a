import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from engine_ref.loading.tokenizer import ChatTemplateError, Tokenizer, eos_ids_for
from engine_ref.loading.weights import load_tokenizer

SAMPLES = [
    "Hello world",
    "The year 2024 had 365 days; pi = 3.14159 and 1234567890",
    "  leading spaces\n\nnewlines\t\ttabs  trailing   ",
    "I'm sure you'll see we've done it, haven't we? ÉCOLE café naïve",
    "東京 北京 Москва 😀🎉 ꙮ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # comment {}[]<>",
    "a" * 200,
    "",
]


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.backend, name="t", chat_template=template, eos_token_ids=tok.eos_token_ids)


def test_template_raise_exception_becomes_chat_template_error(tiny_tokenizer):
    tok = _with_template(
        tiny_tokenizer,
        "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversation must start with a user') }}{% endif %}ok",
    )
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="must start with a user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_is_sandboxed(tiny_tokenizer):
    tok = _with_template(tiny_tokenizer, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_has_hf_helpers(tiny_tokenizer):
    # trim_blocks/lstrip_blocks as in transformers; tojson keeps non-ASCII
    template = "{% for m in messages %}\n  {{ m | tojson }}\n{% endfor %}{{ eos_token }}"
    tok = _with_template(tiny_tokenizer, template)
    assert (
        tok.apply_chat_template([{"role": "user", "content": "é"}])
        == '  {"role": "user", "content": "é"}\n<|im_end|>'
    )


def test_missing_or_broken_template(tiny_tokenizer):
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        _with_template(tiny_tokenizer, "").apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        _with_template(tiny_tokenizer, "{% for %}").apply_chat_template([])


def test_eos_ids_for_adds_known_end_tokens_once():
    backend = BackendTokenizer(models.BPE(vocab={"a": 0, "</s>": 1, "<|eot_id|>": 2}, merges=[]))
    assert eos_ids_for(backend, [1, None]) == (1, 2)
    assert eos_ids_for(backend, [0]) == (0, 2, 1)


def test_special_token_ids_must_be_in_vocabulary(tiny_tokenizer):
    with pytest.raises(ValueError, match="outside vocabulary"):
        Tokenizer(tiny_tokenizer.backend, name="x", eos_token_ids=(100000,))


@pytest.fixture(scope="module")
def smollm2_tokenizers(smollm2_path):
    """(ours, transformers' own conversion of the same GGUF tokenizer)."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    return load_tokenizer("smollm2-135m"), theirs


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES)
def test_smollm2_encodes_like_transformers(smollm2_tokenizers, text):
    ours, theirs = smollm2_tokenizers
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_tokenizer_facts(smollm2_tokenizers):
    ours, theirs = smollm2_tokenizers
    assert ours.vocab_size == 49152
    assert ours.eos_token_ids == (2, 0)  # <|im_end|>, then <|endoftext|>
    assert ours.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert ours.special_token_ids == frozenset(range(17))
    assert ours.encode("Hello world") == [19556, 905]
    # digits are split one by one (SmolLM2's Digits pre-tokenizer)
    assert ours.convert_ids_to_tokens(ours.encode(" 2024")) == ["Ġ", "2", "0", "2", "4"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rendered == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
