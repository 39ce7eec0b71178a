"""The SSE parser on hand-made byte streams, split at awkward read boundaries."""

from __future__ import annotations

import json

import pytest

from harness.http.sse import parse_body, parse_stream, split_events
from slo.runrecord import TokenSource


def _completion(text: str, finish: str | None = None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    return (
        f'data: {{"choices":[{{"index":0,"text":"{text}","finish_reason":{reason}}}]}}\n\n'.encode()
    )


USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def _reads(blob: bytes, sizes: list[int]) -> list[tuple[int, bytes]]:
    out, pos, t = [], 0, 100
    for size in sizes:
        out.append((t, blob[pos : pos + size]))
        pos += size
        t += 10
    if pos < len(blob):
        out.append((t, blob[pos:]))
    return out


def test_events_take_the_time_of_the_read_that_completes_them():
    blob = _completion("He") + _completion("llo", "length") + USAGE + DONE
    first_len, second_len = len(_completion("He")), len(_completion("llo", "length"))
    # The first read ends 3 bytes into the second event; the second read completes it.
    reads = _reads(blob, [first_len + 3, second_len - 3])
    parsed = parse_stream(reads, chat=False)
    assert parsed.error_class is None
    assert parsed.text == "Hello"
    assert parsed.chunks[:2] == [(100, 1, 2), (110, 1, 3)]
    assert parsed.finish_reason == "length"
    assert parsed.usage["completion_tokens"] == 2
    assert parsed.saw_done


def test_one_byte_reads_and_crlf_line_endings():
    blob = (_completion("a") + _completion("b") + DONE).replace(b"\n", b"\r\n")
    parsed = parse_stream(_reads(blob, [1] * len(blob)), chat=False)
    assert parsed.error_class is None
    assert parsed.text == "ab"
    assert [n for _, n, _ in parsed.chunks] == [1, 1]


def test_comments_and_multiline_data_fields():
    blob = (
        b': keep-alive\n\nevent: message\ndata: {"choices":[{"index":0,\ndata: "text":"x"}]}\n\n'
        + DONE
    )
    parsed = parse_stream([(5, blob)], chat=False)
    assert parsed.error_class is None
    assert parsed.text == "x"


def test_chat_role_chunk_is_not_token_bearing():
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    tok = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":"stop"}]}\n\n'
    parsed = parse_stream([(1, role), (2, tok), (3, DONE)], chat=True)
    assert parsed.chunks == [(1, 0, 0), (2, 1, 2)]
    assert parsed.finish_reason == "stop"


@pytest.mark.parametrize(
    ("blob", "error_class"),
    [
        (_completion("a"), "incomplete_stream"),
        (_completion("a") + b'data: {"choi', "incomplete_stream"),
        (b"this is not sse\n\n" + DONE, "malformed_sse"),
        (b"data: {oops\n\n" + DONE, "malformed_json"),
        (b"data: [1, 2]\n\n" + DONE, "malformed_json"),
        (b'data: {"choices": 5}\n\n' + DONE, "malformed_json"),
        (DONE + _completion("late"), "malformed_sse"),
        (b'data: {"error": {"message": "boom"}}\n\n' + DONE, "stream_error"),
    ],
)
def test_broken_streams_are_classified(blob, error_class):
    parsed = parse_stream([(1, blob)], chat=False)
    assert parsed.error_class == error_class
    assert parsed.error_message


def test_split_events_keeps_trailing_partial_event():
    events, trailing, problem = split_events([(1, b"data: a\n\ndata: b")])
    assert events == [(1, b"a")]
    assert trailing == b"data: b"
    assert problem is None


def test_non_streamed_bodies():
    ok = parse_body(
        b'{"choices":[{"message":{"content":"Paris"},"finish_reason":"stop"}],"usage":{"completion_tokens":2}}',
        chat=True,
    )
    assert (ok.text, ok.finish_reason, ok.usage["completion_tokens"]) == ("Paris", "stop", 2)
    assert parse_body(b"<html>", chat=False).error_class == "malformed_json"
    assert parse_body(b'{"choices": []}', chat=False).error_class == "malformed_json"


def _event(text: str | None, *, so_far: int | None = None, ids: int | None = None, finish=None):
    choice: dict = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = list(range(ids))
    obj: dict = {"choices": [choice]}
    if so_far is not None:
        obj["usage"] = {"prompt_tokens": 3, "completion_tokens": so_far, "total_tokens": 3 + so_far}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _final_usage(n: int) -> bytes:
    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
    return b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"


@pytest.mark.parametrize(
    ("events", "n_tokens", "source"),
    [
        # vLLM's continuous usage: each event's count is the growth of the usage so far.
        ([_event("a", so_far=1), _event("bcd", so_far=4), _event("e", so_far=5), _final_usage(5)],
         [1, 3, 1, 0], TokenSource.USAGE),
        # a token without text (EOS on the finishing event) counts on the event that said it
        ([_event("a", so_far=2), _event("", so_far=3, finish="stop"), _final_usage(3)],
         [2, 1, 0], TokenSource.USAGE),
        # an incomplete UTF-8 character held back: its tokens come in events without text,
        # the usage so far still growing; the character's text arrives on a later event
        ([_event("a", so_far=1), _event("", so_far=2), _event("", so_far=3),
          _event("\u00e9", so_far=4), _event("b", so_far=5), _final_usage(5)],
         [1, 1, 1, 1, 1, 0], TokenSource.USAGE),
        # a text-less event that says no growth, or less, counts none
        ([_event("", so_far=0), _event("a", so_far=2), _event("", so_far=1), _final_usage(2)],
         [0, 2, 0, 1], TokenSource.USAGE),
        # return_token_ids: an event without text counts the ids it carries
        ([_event("a", ids=1), _event("", ids=2), _event("bc", ids=1), _event("", ids=0)],
         [1, 2, 1, 0], TokenSource.TOKEN_IDS),
        # neither: events without text say nothing of their tokens
        ([_event("a"), _event(""), _event("b")], [1, 0, 1], TokenSource.CHUNK_COUNT),
        # return_token_ids: the ids each event carries
        ([_event("ab", ids=2), _event("c", ids=1), _event("d", ids=5)], [2, 1, 5],
         TokenSource.TOKEN_IDS),
        # usage only on the last text event (a one-off total): not a per-event count
        ([_event("a"), _event("b"), _event("c", so_far=9, finish="length")], [1, 1, 1],
         TokenSource.CHUNK_COUNT),
        # usage on some text events but not all: not trusted either
        ([_event("a", so_far=1), _event("b"), _event("c", so_far=7)], [1, 1, 1],
         TokenSource.CHUNK_COUNT),
        # a text event counts at least one even where its count says 0 or less
        ([_event("a", so_far=0), _event("b", so_far=2), _event("c", so_far=2)], [1, 2, 1],
         TokenSource.USAGE),
        ([_event("a", ids=0)], [1], TokenSource.TOKEN_IDS),
        # nothing but an empty event: no source
        ([_event("")], [0], None),
    ],
)  # fmt: skip
def test_each_events_tokens_come_from_the_tokens(events, n_tokens, source):
    out = parse_stream(_reads(b"".join(events) + DONE, [7]), chat=False)
    assert out.error_class is None
    assert [n for _, n, _ in out.chunks] == n_tokens
    assert out.chunk_tokens_source is source


def test_a_usage_that_is_not_an_object_is_ignored_for_counting():
    blob = b'data: {"choices":[{"index":0,"text":"ab"}],"usage":"lots"}\n\n' + DONE
    out = parse_stream(_reads(blob, [5]), chat=False)
    assert out.error_class is None and [n for _, n, _ in out.chunks] == [1]
    assert out.chunk_tokens_source is TokenSource.CHUNK_COUNT


_EQUIVALENCE_STREAMS = {
    "plain": _completion("He") + _completion("llo", "length") + USAGE + DONE,
    "no-done": _completion("a") + _completion("b"),
    "only-done": DONE,
    "data-after-done": _completion("a") + DONE + _completion("late"),
    "done-in-the-middle": DONE + DONE,
    "comment": b": ping\n\n" + _completion("a") + DONE,
    "blank-events": _completion("a") + b"\n\n" + _completion("b") + DONE,
    "multi-line": b'data: {"choices":[{"index":0,\ndata: "text":"x"}]}\n\n' + DONE,
    "crlf": (_completion("a") + DONE).replace(b"\n", b"\r\n"),
    "bad-json": b"data: {oops\n\n" + DONE,
    "two-values-in-one-event": b'data: {"choices":[]},{"choices":[]}\n\n' + DONE,
    "not-an-object": b"data: [1, 2]\n\n" + DONE,
    "escaped-newline-in-text": _completion("a\\n\\ndata: b") + DONE,
    "cut-inside-an-event": _completion("a") + b'data: {"choi',
    "error-event": b'data: {"error": {"message": "boom"}}\n\n' + DONE,
    "usage-so-far": (
        b'data: {"choices":[{"index":0,"text":"ab"}],"usage":{"completion_tokens":2}}\n\n'
        b'data: {"choices":[{"index":0,"text":"c"}],"usage":{"completion_tokens":3}}\n\n' + DONE
    ),
    "token-ids": b'data: {"choices":[{"index":0,"text":"ab","token_ids":[5,6]}]}\n\n' + DONE,
}


@pytest.mark.parametrize("name", sorted(_EQUIVALENCE_STREAMS))
def test_the_whole_stream_fast_path_agrees_with_the_event_by_event_parser(name, monkeypatch):
    """`parse_stream` decodes a well-formed stream in whole-stream passes; every stream, split
    at every byte, parses exactly as the general event-by-event path parses it. Both are the
    Python parser's paths: the compiled scanner (tested against them in test_sse_native.py)
    is switched off here."""
    import harness.http.sse as sse
    from harness.http import sse_native

    monkeypatch.setattr(sse_native, "scan", lambda _reads, chat: None)

    blob = _EQUIVALENCE_STREAMS[name]
    splits = [[cut] for cut in range(1, len(blob))] + [[len(blob)], [1] * len(blob)]
    for sizes in splits:
        reads = _reads(blob, sizes)
        fast = parse_stream(reads, chat=False)
        with monkeypatch.context() as m:
            m.setattr(sse, "_fast_events", lambda _reads: None)
            general = parse_stream(reads, chat=False)
        assert fast == general, (name, sizes)
    if name in ("plain", "usage-so-far", "token-ids", "only-done", "not-an-object"):
        assert sse._fast_events(_reads(blob, [len(blob)])) is not None  # the fast path ran
