"""The SSE parser on hand-made byte streams, split at awkward read boundaries."""

from __future__ import annotations

import pytest

from harness.sse import parse_body, parse_stream, split_events


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
