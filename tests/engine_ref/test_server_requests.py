"""Request validation of the OpenAI wire protocol (`serving/requests.py`; no server)."""

from __future__ import annotations

import pytest

from engine_ref.loading.tiny_random import build_tiny_tokenizer
from engine_ref.serving.errors import ApiError
from engine_ref.serving.requests import (
    decode_json_body,
    parse_chat_request,
    parse_completion_request,
)

MODEL = "tiny-random"
MAX_LEN = 64


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _parse_completion(body, tokenizer):
    return parse_completion_request(
        body, tokenizer=tokenizer, served_model=MODEL, max_model_len=MAX_LEN
    )


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b'{"prompt": "a",', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
    ],
)
def test_body_decoding_errors(raw, fragment):
    with pytest.raises(ApiError) as info:
        decode_json_body(raw)
    assert info.value.status == 400 and fragment in info.value.message


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": MAX_LEN}, 400, "max_tokens"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ({"prompt": "hi", "model": 7}, 400, "model"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": 12}, 400, "prompt"),
        ({"prompt": [1, 2, 99999]}, 400, "prompt"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "\ud800"}, 400, "prompt"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"prompt": "hi", "stop": [""]}, 400, "stop"),
        ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
        ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "hi", "top_p": 0.0}, 400, None),
        ({"prompt": "hi", "echo": True}, 400, "echo"),
        ({"prompt": "hi", "best_of": 2}, 400, None),  # best_of above 1 needs beam search
        ({"prompt": "hi", "best_of": 0}, 400, "best_of"),
        ({"prompt": "hi", "use_beam_search": "yes"}, 400, "use_beam_search"),
        ({"prompt": "hi", "use_beam_search": True, "n": 3, "best_of": 2}, 400, None),
        ({"prompt": "hi", "use_beam_search": True, "stop": ["x"]}, 400, None),
        ({"prompt": "hi", "use_beam_search": True, "length_penalty": "1"}, 400, "length_penalty"),
    ],
)
def test_completion_request_errors(body, status, param, tokenizer):
    with pytest.raises(ApiError) as info:
        _parse_completion(body, tokenizer)
    assert info.value.status == status
    assert info.value.param == param
    assert info.value.body()["error"]["message"].endswith(".")


def test_beam_search_fields_reach_sampling_params(tokenizer):
    body = {"prompt": "hi", "max_tokens": 2, "use_beam_search": False, "best_of": 1}
    assert _parse_completion(body, tokenizer).params.beam_width == 0
    body = {"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "n": 2, "best_of": 3,
            "length_penalty": 0.5}  # fmt: skip
    p = _parse_completion(body, tokenizer).params
    assert (p.use_beam_search, p.n, p.beam_width, p.length_penalty) == (True, 2, 3, 0.5)
    chat = {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2}
    p = parse_chat_request(chat, tokenizer=tokenizer, served_model=MODEL, max_model_len=MAX_LEN)
    assert p.params.use_beam_search and p.params.beam_width == 2


def test_context_length_is_prompt_plus_max_tokens(tokenizer):
    prompt = [5] * 10
    ok = _parse_completion({"prompt": prompt, "max_tokens": MAX_LEN - 10}, tokenizer)
    assert ok.params.max_tokens == MAX_LEN - 10
    with pytest.raises(ApiError) as info:
        _parse_completion({"prompt": prompt, "max_tokens": MAX_LEN - 9}, tokenizer)
    assert info.value.code == "context_length_exceeded"
    assert "64 tokens" in info.value.message and "65 tokens" in info.value.message


def test_default_max_tokens_fills_the_context(tokenizer):
    parsed = _parse_completion({"prompt": [5, 6, 7]}, tokenizer)
    assert parsed.params.max_tokens == MAX_LEN - 3


def test_completion_fields_reach_sampling_params(tokenizer):
    parsed = _parse_completion(
        {
            "model": MODEL,
            "prompt": ["a b", [7, 8]],
            "max_tokens": 5,
            "n": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 4,
            "seed": 11,
            "stop": "x",
            "ignore_eos": True,
            "min_tokens": 2,
            "logprobs": 3,
            "priority": -1,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        tokenizer,
    )
    assert parsed.prompts == (tuple(tokenizer.encode("a b")), (7, 8))
    assert parsed.num_choices == 4
    p = parsed.params
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (2, 5, 0.5, 0.9, 4, 11)
    assert (p.stop, p.ignore_eos, p.min_tokens, p.logprobs) == (("x",), True, 2, 3)
    assert parsed.priority == -1 and parsed.stream and parsed.include_usage


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "use_beam_search": "on"},
            "use_beam_search",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
    ],
)
def test_chat_request_errors(body, param, tokenizer):
    with pytest.raises(ApiError) as info:
        parse_chat_request(body, tokenizer=tokenizer, served_model=MODEL, max_model_len=MAX_LEN)
    assert info.value.status == 400 and info.value.param == param


def test_chat_renders_template_and_prefers_max_completion_tokens(tokenizer):
    parsed = parse_chat_request(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_tokens": 9,
            "max_completion_tokens": 4,
            "logprobs": True,
        },
        tokenizer=tokenizer,
        served_model=MODEL,
        max_model_len=MAX_LEN,
    )
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert parsed.prompts == (tuple(tokenizer.encode(expected)),)
    assert parsed.params.max_tokens == 4 and parsed.params.logprobs == 0
