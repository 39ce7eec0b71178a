"""Response bodies of the OpenAI wire protocol (`serving/responses.py` and the endpoint
adapters' chunks; no server)."""

from __future__ import annotations

import pytest

from engine_ref.serving.endpoints import endpoint
from engine_ref.serving.responses import (
    ChoiceAccumulator,
    TokenLogprob,
    completion_logprobs_body,
    sse_event,
)

MODEL = "tiny-random"


def test_completion_logprob_offsets_count_characters():
    entries = [TokenLogprob("ab", -1.0, (("ab", -1.0),)), TokenLogprob("東", -2.0, ())]
    body = completion_logprobs_body(entries, 5)
    assert body == {
        "tokens": ["ab", "東"],
        "token_logprobs": [-1.0, -2.0],
        "top_logprobs": [{"ab": -1.0}, {}],
        "text_offset": [5, 7],
    }


def test_chunks_carry_only_unsent_text_and_finish_once():
    choice = ChoiceAccumulator(0)
    choice.add("He", [1], [], None, 1)
    choice.add("", [2], [], None, 2)  # a token whose character is still incomplete
    first = endpoint("completion").chunk_body(
        "cmpl-1", 0, MODEL, choice, with_logprobs=False, with_token_ids=True
    )
    assert first["choices"][0] == {
        "index": 0,
        "text": "He",
        "logprobs": None,
        "finish_reason": None,
        "token_ids": [1, 2],
    }
    assert not choice.has_pending()
    choice.add("", [0], [], None, 3)  # a special token: no text, yet a chunk is due
    assert choice.has_pending()
    assert endpoint("chat").chunk_body(
        "c", 0, MODEL, choice, with_logprobs=False, with_token_ids=False
    )["choices"][0]["delta"] == {"content": ""}
    choice.add("", [3], [], "stop", 4)
    assert choice.has_pending()  # the finish reason is due
    last = endpoint("chat").chunk_body(
        "chatcmpl-1", 0, MODEL, choice, with_logprobs=False, with_token_ids=False
    )
    assert last["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert not choice.has_pending()


def _finished_choice() -> ChoiceAccumulator:
    choice = ChoiceAccumulator(0)
    choice.add("Hi", [7, 8], [TokenLogprob("H", -0.5, ()), TokenLogprob("i", -1.0, ())], None, 2)
    choice.add("", [9], [TokenLogprob("", -2.0, ())], "length", 3)
    return choice


def test_complete_bodies_of_each_endpoint():
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    completion = endpoint("completion").response_body(
        "cmpl-1", 5, MODEL, [_finished_choice()], usage, with_logprobs=False, with_token_ids=True
    )
    assert completion == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": "Hi",
                "logprobs": None,
                "finish_reason": "length",
                "token_ids": [7, 8, 9],
            }
        ],
        "usage": usage,
    }
    chat = endpoint("chat").response_body(
        "chatcmpl-1",
        5,
        MODEL,
        [_finished_choice()],
        usage,
        with_logprobs=True,
        with_token_ids=False,
    )
    assert chat["object"] == "chat.completion"
    (item,) = chat["choices"]
    assert item["message"] == {"role": "assistant", "content": "Hi"}
    assert [e["token"] for e in item["logprobs"]["content"]] == ["H", "i", ""]
    assert item["logprobs"]["content"][0]["bytes"] == [72]


def test_only_a_chat_stream_opens_with_role_chunks():
    choices = [ChoiceAccumulator(0), ChoiceAccumulator(1)]
    assert endpoint("completion").opening_chunks("c", 0, MODEL, choices, with_token_ids=True) == []
    opening = endpoint("chat").opening_chunks("c", 0, MODEL, choices, with_token_ids=True)
    assert [chunk["choices"] for chunk in opening] == [
        [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": [],
            }
        ]
        for i in (0, 1)
    ]
    assert {chunk["object"] for chunk in opening} == {"chat.completion.chunk"}


def test_usage_chunk_and_sse_framing():
    chunk = endpoint("completion").usage_chunk("c", 0, MODEL, {"total_tokens": 1})
    assert chunk["choices"] == [] and chunk["usage"] == {"total_tokens": 1}
    assert sse_event({"text": "東"}) == 'data: {"text":"東"}\n\n'.encode()


def test_unknown_endpoint_names_the_known_ones():
    with pytest.raises(KeyError, match="known endpoints: chat, completion"):
        endpoint("embeddings")
