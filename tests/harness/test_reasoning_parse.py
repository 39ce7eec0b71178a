"""Reasoning and answer told apart in a stream (`harness.http.reasoning`), through the public
parser (`parse_stream`, `parse_body`) and the record builder (`to_rows`): the delta keys
`reasoning_content` and `reasoning`, and `<think>` spans in plain content cut across events
in every way, with the compiled scanner on and off giving the same result."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness.http import sse, sse_native
from harness.http.client import RawResult
from harness.http.reasoning import Part
from harness.load.records import RecordContext, to_rows

A, R, B = Part.ANSWER, Part.REASONING, Part.BOTH


def _chat(*deltas: dict, usage: list[int] | None = None) -> list[tuple[int, bytes]]:
    """One read per event at t = 10, 20, ...: each delta an event, then [DONE]; `usage` gives
    each event's usage so far (continuous usage stats)."""
    reads = []
    for i, delta in enumerate(deltas):
        event = {"id": "c1", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        if usage is not None:
            event["usage"] = {"prompt_tokens": 2, "completion_tokens": usage[i]}
        reads.append((10 * (i + 1), b"data: " + json.dumps(event).encode() + b"\n\n"))
    reads.append((10 * (len(deltas) + 1), b"data: [DONE]\n\n"))
    return reads


def _content(*pieces: str) -> list[tuple[int, bytes]]:
    return _chat(*({"content": p} for p in pieces))


def _both_ways(reads, monkeypatch, *, chat: bool = True) -> sse.ParsedStream:
    """The stream parsed with the scanner (where there is one) and without: equal."""
    scanned = sse.parse_stream(reads, chat=chat)
    with monkeypatch.context() as m:
        m.setattr(sse_native, "scan", lambda _reads, chat: None)
        python = sse.parse_stream(reads, chat=chat)
    assert scanned == python
    assert scanned.error_class is None
    return python


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_a_reasoning_key_is_reasoning_and_content_the_answer(key, monkeypatch):
    reads = _chat({"role": "assistant", "content": ""}, {key: "Let"}, {key: " me"},
                  {"content": "Hi"}, {"content": "!"}, {})  # fmt: skip
    parsed = _both_ways(reads, monkeypatch)
    assert (parsed.reasoning_text, parsed.text) == ("Let me", "Hi!")
    assert parsed.part.tolist() == [A, R, R, A, A, A]
    assert parsed.n_chars.tolist() == [0, 3, 3, 2, 1, 0]
    assert parsed.n_tokens.tolist() == [0, 1, 1, 1, 1, 0]  # one per text event


def test_both_keys_with_one_text_are_read_once_and_null_is_none(monkeypatch):
    """vLLM 0.11 sent `reasoning` and `reasoning_content` with the same text; SGLang sends
    `"reasoning_content": null` beside the answer."""
    reads = _chat({"reasoning": "ab", "reasoning_content": "ab"},
                  {"content": "c", "reasoning_content": None})  # fmt: skip
    parsed = _both_ways(reads, monkeypatch)
    assert (parsed.reasoning_text, parsed.text) == ("ab", "c")
    assert parsed.part.tolist() == [R, A]


def test_an_event_with_both_counts_as_answer_and_empty_reasoning_marks_reasoning(monkeypatch):
    reads = _chat({"reasoning_content": ""}, {"reasoning_content": "x"},
                  {"reasoning_content": "y", "content": "z"}, {"content": ""})  # fmt: skip
    parsed = _both_ways(reads, monkeypatch)
    assert parsed.part.tolist() == [R, R, B, A]  # the last: no text, takes the event before's
    assert (parsed.reasoning_text, parsed.text) == ("xy", "z")


TEXT = "<think>ab</think>cd"


@pytest.mark.parametrize("size", range(1, len(TEXT) + 1))
def test_think_tags_cut_anywhere_split_the_same(size, monkeypatch):
    """`<think>ab</think>cd` in pieces of 1..19 characters: always reasoning `ab`, answer
    `cd`; each event's part by what it carries (tags and held-back tag text count as the
    reasoning they open or close)."""
    pieces = [TEXT[i : i + size] for i in range(0, len(TEXT), size)]
    parsed = _both_ways(_content(*pieces), monkeypatch)
    assert (parsed.reasoning_text, parsed.text) == ("ab", "cd")
    reasoning_end = len("<think>ab</think>")  # characters up to and including the close tag
    expected = []
    start = 0
    for piece in pieces:
        end = start + len(piece)
        if end <= reasoning_end:
            expected.append(R)
        elif start >= reasoning_end:
            expected.append(A)
        else:  # the close tag's end and answer text: reasoning text too when it has a or b
            expected.append(B if start <= TEXT.index("b") else A)
        start = end
    assert parsed.part.tolist() == expected


@pytest.mark.parametrize(
    ("pieces", "reasoning", "answer", "parts"),
    [
        (["<think>", "abc"], "abc", "", [R, R]),  # no closing tag: reasoning to the end
        (["<think>", "</think>", "hi"], "", "hi", [R, R, A]),  # empty think
        (["hey ", "<think>x", "</think>", "y"], "x", "hey y", [A, R, R, A]),  # text before
        (["ab<th"], "", "ab<th", [A]),  # a partial tag at the end is text
        (["a</think>b"], "", "a</think>b", [A]),  # a close tag without an open one: answer
        (["<think>a</think>b<think>c</think>"], "a", "b<think>c</think>", [B]),  # one span
        (["<think>a<", "/thinking>"], "a</thinking>", "", [R, R]),  # held back, then text
    ],
)
def test_think_tag_table(pieces, reasoning, answer, parts, monkeypatch):
    parsed = _both_ways(_content(*pieces), monkeypatch)
    assert (parsed.reasoning_text, parsed.text) == (reasoning, answer)
    assert parsed.part.tolist() == parts


def test_completions_text_is_split_too(monkeypatch):
    reads = []
    for i, text in enumerate(["<think>", "ok", "</think>", "yes"]):
        event = {"id": "x", "choices": [{"index": 0, "text": text}]}
        reads.append((i + 1, b"data: " + json.dumps(event).encode() + b"\n\n"))
    reads.append((9, b"data: [DONE]\n\n"))
    parsed = _both_ways(reads, monkeypatch, chat=False)
    assert (parsed.reasoning_text, parsed.text) == ("ok", "yes")


def test_the_scanner_leaves_streams_with_reasoning_to_python_and_takes_the_rest():
    if not sse_native.available():
        pytest.skip("no C compiler here")
    assert sse_native.scan(_chat({"reasoning_content": "a"}, {"content": "b"}), chat=True) is None
    assert sse_native.scan(_chat({"content": "b", "reasoning": ""}), chat=True) is None
    nulls = sse_native.scan(_chat({"content": "b", "reasoning_content": None}), chat=True)
    assert nulls is not None and nulls.text == b"b"  # SGLang's null beside the answer
    assert sse_native.scan(_content("<th", "ink>a"), chat=True) is None  # joined text has it
    plain = sse_native.scan(_content("<thin", "k", " no"), chat=True)  # `<think` never closes
    assert plain is not None and plain.text == b"<think no"


def test_a_whole_answer_splits_its_message():
    body = {"id": "c", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "yes", "reasoning_content": "hmm"}}]}  # fmt: skip
    parsed = sse.parse_body(json.dumps(body).encode(), chat=True)
    assert (parsed.reasoning_text, parsed.text) == ("hmm", "yes")
    inline = {"id": "c", "choices": [{"index": 0, "message": {"content": "<think>a</think>b"}}]}
    parsed = sse.parse_body(json.dumps(inline).encode(), chat=True)
    assert (parsed.reasoning_text, parsed.text) == ("a", "b")


def _raw(reads, body=None) -> RawResult:
    return RawResult(request_id="q", is_warmup=False, t_scheduled_ns=0, t_sent_ns=5,
                     t_first_byte_ns=8, t_done_ns=100, reads=reads, body=body)  # fmt: skip


def test_records_carry_the_reasoning_columns_and_chunk_markers():
    """Events at 10..60 ns (t0 0): role, <think> (1 token, empty reasoning), 2 reasoning,
    `</think>` (1 token), 2 answer tokens; usage so far 0,1,2,3,4,5,6 and the server's count of
    4 reasoning tokens on the last."""
    reads = _chat({"role": "assistant", "content": ""}, {"reasoning_content": ""},
                  {"reasoning_content": "a"}, {"reasoning_content": "b"},
                  {"reasoning_content": ""}, {"content": "c"}, {"content": "d"},
                  usage=[0, 1, 2, 3, 4, 5, 6])  # fmt: skip
    last = json.loads(reads[-2][1][6:])
    last["usage"]["completion_tokens_details"] = {"reasoning_tokens": 4}
    reads[-2] = (reads[-2][0], b"data: " + json.dumps(last).encode() + b"\n\n")
    record, chunks = to_rows(_raw(reads), 3, RecordContext(t0_ns=0, is_chat=True))
    assert record.t_first_token_ns == 20
    assert (record.t_first_reasoning_token_ns, record.t_last_reasoning_token_ns) == (20, 50)
    assert record.t_first_answer_token_ns == 60
    assert (record.output_reasoning_tokens, record.output_answer_tokens) == (4, 2)
    assert (record.usage_reasoning_tokens, record.usage_completion_tokens) == (4, 6)
    assert record.output_chars == 2  # the answer `cd`: what output checks see
    assert chunks.reasoning.tolist() == [False, True, True, True, True, False, False]


def test_records_of_a_stream_without_reasoning_put_every_token_in_the_answer():
    record, chunks = to_rows(_raw(_content("a", "b")), 3, RecordContext(t0_ns=0, is_chat=True))
    assert (record.output_reasoning_tokens, record.output_answer_tokens) == (0, 2)
    assert record.t_first_answer_token_ns == record.t_first_token_ns == 10
    assert record.t_first_reasoning_token_ns is None and record.usage_reasoning_tokens is None
    assert not chunks.reasoning.any()


def test_records_of_a_stream_without_reasoning_start_the_answer_at_its_first_token():
    """A role-only first event carries no token: the first answer token is the next event's."""
    reads = _chat({"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"})
    record, chunks = to_rows(_raw(reads), 3, RecordContext(t0_ns=0, is_chat=True))
    assert record.t_first_answer_token_ns == record.t_first_token_ns == 20
    assert (record.output_reasoning_tokens, record.output_answer_tokens) == (0, 2)
    assert record.t_first_reasoning_token_ns is None and record.t_last_reasoning_token_ns is None
    assert chunks.reasoning.tolist() == [False, False, False]


def test_records_of_a_whole_answer_take_the_servers_reasoning_count():
    body = {"id": "c", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "content": "yes", "reasoning_content": "hmm"}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 9,
                  "completion_tokens_details": {"reasoning_tokens": 7}}}  # fmt: skip
    record, _ = to_rows(
        _raw([], json.dumps(body).encode()), 2, RecordContext(t0_ns=0, is_chat=True)
    )
    assert (record.output_reasoning_tokens, record.output_answer_tokens) == (7, 2)
    assert record.t_first_reasoning_token_ns is None  # no token times without a stream
    no_usage = {**body, "usage": {"prompt_tokens": 2, "completion_tokens": 9}}
    ctx = RecordContext(t0_ns=0, is_chat=True, count_tokens=len)  # one token a character
    record, _ = to_rows(_raw([], json.dumps(no_usage).encode()), 2, ctx)
    assert (record.output_reasoning_tokens, record.output_answer_tokens) == (3, 6)


def test_a_split_costs_nothing_to_a_stream_without_reasoning(monkeypatch):
    """Streams without reasoning parse to the same columns with or without the scanner, and
    every part is answer (a guard on the fast path's result, not its speed)."""
    parsed = _both_ways(_content("x", "y", "z"), monkeypatch)
    assert np.array_equal(parsed.part, np.zeros(3, np.int8)) and parsed.reasoning_text == ""
