"""The compiled scanner's shortcut for an event that repeats the one before it but for its text.

A server's chunks differ in their text only, so the scanner reads such an event as the last
fully parsed one with a new text string (`repeat_event` in `sse_scan.c`). Every stream here
must give the same `ParsedStream` as the Python parser, split at several read boundaries, and
the streams the scanner must take itself are marked, as in `test_sse_native`.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sse import _reads
from test_sse_native import DONE, _agree, _event, assert_parse_alike, event, json_text

from harness.http import sse, sse_native

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here"
)

MOCK_EVENT = (
    b'{"id":"x","object":"text_completion","model":"mock",'
    b'"choices":[{"index":0,"text":"%s","finish_reason":null}]}'
)


def _mock(*texts: bytes) -> bytes:
    return b"".join(_event(MOCK_EVENT % text) for text in texts)


CUT_IN_TEXT = (MOCK_EVENT % b"abcdef")[: MOCK_EVENT.index(b"%s") + 3]  # ends after `abc`


# name: (stream, chat, the scanner must take it itself)
REPEATS = {
    "texts-of-every-kind": (
        _mock(b" tok", b" tok", b"", b"a", b"\\u00e9\\n", b"caf\xc3\xa9", b"\\ud83d\\ude00", b"x")
        + DONE,
        False,
        True,
    ),
    "a-repeat-longer-than-the-template": (_mock(b"a", b"b" * 300, b"c") + DONE, False, True),
    "chat-content-repeats": (
        b"".join(
            _event({"id": "c", "choices": [{"index": 0, "delta": {"content": t}}]})
            for t in ["", "He", "llo", "", "\u6771", "!"]
        )
        + DONE,
        True,
        True,
    ),
    "finish-reason-and-usage-after-the-text": (
        b"".join(
            _event({"choices": [{"text": t, "finish_reason": f}], "usage": {"prompt_tokens": 3}})
            for t, f in [("a", "stop"), ("bcd", "stop"), ("", "stop"), ("ef", None)]
        )
        + DONE,
        False,
        True,
    ),
    "id-and-usage-before-the-text": (
        b"".join(
            _event({"id": "r7", "usage": {"completion_tokens": 4}, "choices": [{"text": t}]})
            for t in ["a", "bb", "ccc"]
        )
        + DONE,
        False,
        True,
    ),
    "the-head-differs": (  # the same text at the same offset, another usage so far before it
        b"".join(
            _event({"usage": {"completion_tokens": n}, "choices": [{"text": "a"}]})
            for n in [1, 2, 3, 5]
        )
        + DONE,
        False,
        True,
    ),
    "a-later-text-key-decides": (  # the template's text is the last `text` key's
        _event(b'{"choices":[{"text":"a","text":"b"}]}')
        + _event(b'{"choices":[{"text":"a","text":"cd"}]}')
        + _event(b'{"choices":[{"text":"zz","text":"e"}]}')
        + DONE,
        False,
        True,
    ),
    "a-later-delta-forgets-the-text": (
        _event(b'{"choices":[{"delta":{"content":"a"},"delta":5}]}')
        + _event(b'{"choices":[{"delta":{"content":"b"},"delta":5}]}')
        + _event(b'{"choices":[{"delta":{"content":"c"}}]}')
        + DONE,
        True,
        True,
    ),
    "the-tail-differs": (
        _event({"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}})
        + _event({"choices": [{"text": "b"}], "usage": {"completion_tokens": 2}})
        + _event({"choices": [{"text": "c"}], "usage": {"completion_tokens": 3}})
        + DONE,
        False,
        True,
    ),
    "text-null-where-the-template-has-a-string": (
        _event({"choices": [{"text": "a"}]}) + _event({"choices": [{"text": None}]}) + DONE,
        False,
        True,
    ),
    # The Python parser's to decide, after a template the scanner kept.
    "a-bad-escape-in-a-repeat": (_mock(b"a", b"\\x41") + DONE, False, False),
    "a-raw-newline-in-a-repeat": (_mock(b"a", b"b\nc") + DONE, False, False),
    "invalid-utf8-in-a-repeat": (_mock(b"a", b"\xc3\x28") + DONE, False, False),
    "a-repeat-cut-short": (_mock(b"a") + b'data: {"id":"x","object":"text_co', False, False),
    "a-repeat-cut-inside-its-text": (_mock(b"a") + b"data: " + CUT_IN_TEXT, False, False),
}


@pytest.mark.parametrize("name", sorted(REPEATS))
def test_repeats_parse_as_the_python_parser_reads_them(name, monkeypatch):
    blob, chat, scanner_takes_it = REPEATS[name]
    took = _agree(blob, chat, monkeypatch)
    assert took is scanner_takes_it, f"the scanner {'took' if took else 'refused'} {name!r}"


def test_repeats_keep_the_id_finish_reason_and_usage_they_carry():
    """Repeats with texts of other lengths than the first event's: the id, finish reason and
    usage object are read whole from the stream."""
    blob = b"".join(
        _event({"id": "c1", "choices": [{"text": t, "finish_reason": "st"}], "usage": {"n": 1}})
        for t in ["a", "\u00e9\u00e9\u00e9", "", "long text"]
    )
    scanned = sse_native.scan(_reads(blob + DONE, [7]), chat=False)
    assert scanned is not None
    spans = (scanned.response_id, scanned.finish_reason, scanned.usage_object)
    assert spans == (b'"c1"', b'"st"', b'{"n": 1}')


def test_distinct_texts_start_afresh_in_every_stream():
    """The table of distinct texts is emptied after each scan, also after one that gave up."""
    many = _mock(*[str(i).encode() for i in range(300)]) + DONE
    refused = _mock(b"q", b"r") + _event(b'{"choices":[{"text":"\\x"}]}') + DONE
    small = _mock(b"7", b"b", b"7") + DONE
    for blob in (many, refused, small):
        sse_native.scan(_reads(blob, [len(blob)]), chat=False)
    parsed = sse.parse_stream(_reads(small, [len(small)]), chat=False)
    assert parsed.texts == ["7", "b"]
    assert parsed.text_id.tolist() == [0, 1, 0]


def _with_text(obj: dict, text: str, chat: bool) -> dict:
    obj = copy.deepcopy(obj)
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        choices = obj["choices"] = [{}]
    if chat:
        delta = choices[0].get("delta")
        if not isinstance(delta, dict):
            delta = choices[0]["delta"] = {}
        delta["content"] = text
    else:
        choices[0]["text"] = text
    return obj


@settings(max_examples=200, deadline=None)
@given(
    skeleton=event,
    texts=st.lists(json_text, min_size=1, max_size=8),
    chat=st.booleans(),
    ascii_only=st.booleans(),
    cut=st.integers(1, 50),
)
def test_random_events_repeated_with_other_texts_parse_alike(
    skeleton, texts, chat, ascii_only, cut
):
    """One random event, its text replaced event by event: the scanner's shortcut, where it
    takes it, must give what the Python parser gives."""
    blob = (
        b"".join(
            _event(json.dumps(_with_text(skeleton, t, chat), ensure_ascii=ascii_only).encode())
            for t in texts
        )
        + DONE
    )
    assert_parse_alike(blob, chat, cut)
