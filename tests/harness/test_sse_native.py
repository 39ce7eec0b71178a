"""The compiled stream scanner (`harness.http.sse_native`) against the Python parser it stands in
for.

Every stream here is parsed twice through `parse_stream`, once with the scanner and once with
it switched off, split at several read boundaries; the two `ParsedStream`s must be equal field
for field (times, token and character counts, texts, usage, finish reason, id, errors). The
streams the scanner must take itself are marked, so a scanner that gave up on everything would
fail, not pass by falling back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sse import _reads  # the same read splitter as the Python parser's tests

from harness.http import sse, sse_native
from harness.http.client import RawResult
from harness.load.records import RecordContext, to_rows

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here"
)


def test_the_scanner_builds_and_loads_where_there_is_a_compiler():
    assert sse_native.available(), "a C compiler is here, yet the scanner did not build"


def _event(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _text(text, **choice) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, **choice}],
    }


def _delta(content, **choice) -> dict:
    return {"id": "chat-1", "choices": [{"index": 0, "delta": {"content": content}, **choice}]}


DONE = b"data: [DONE]\n\n"
USAGE = _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


def _splits(blob: bytes) -> list[list[int]]:
    n = len(blob)
    cuts = sorted({1, 5, 6, 7, n // 3, n // 2, n - 2, n - 1})
    return [[len(blob)], [1] * n, *[[c] for c in cuts if 0 < c < n], [max(1, n // 5)] * 5]


def _python_only(reads, chat, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(sse_native, "scan", lambda _reads, chat: None)
        return sse.parse_stream(reads, chat=chat)


def _agree(blob: bytes, chat: bool, monkeypatch) -> bool:
    """Both parsers agree on every split; returns whether the scanner took the whole stream."""
    took = sse_native.scan(_reads(blob, [len(blob)]), chat=chat) is not None
    for sizes in _splits(blob):
        reads = _reads(blob, sizes)
        native = sse.parse_stream(reads, chat=chat)
        python = _python_only(reads, chat, monkeypatch)
        assert native == python, (blob[:120], sizes)
        assert native.chunks == python.chunks
    return took


# name: (stream, chat, the scanner must take it itself)
STREAMS = {
    "mock-completions": (
        _event(_text(" tok", finish_reason=None)) * 40
        + _event(
            {
                "id": "x",
                "choices": [{"index": 0, "text": "", "delta": {}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 16, "completion_tokens": 40, "total_tokens": 56},
            }
        )
        + DONE,
        False,
        True,
    ),
    "chat-role-then-content": (
        _event({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        + _event(_delta("Hel"))
        + _event(_delta("lo", finish_reason="stop"))
        + USAGE
        + DONE,
        True,
        True,
    ),
    "chat-null-content-and-a-delta-that-is-not-an-object": (
        _event(_delta(None)) + _event({"choices": [{"delta": 5}]}) + _event(_delta("x")) + DONE,
        True,
        True,
    ),
    "chat-reads-delta-not-text": (
        _event({"choices": [{"text": "no", "delta": {"content": "yes"}}]}) + DONE,
        True,
        True,
    ),
    "completions-read-text-not-delta": (
        _event({"choices": [{"text": "yes", "delta": {"content": "no"}}]}) + DONE,
        False,
        True,
    ),
    "unicode-raw-and-escaped": (
        _event(b'{"choices":[{"text":"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"}]}')
        + _event(b'{"choices":[{"text":"\\u00e9\\u20ac\\ud83d\\ude00\\n\\t\\"\\\\\\/\\b\\f\\r"}]}')
        + _event(b'{"choices":[{"text":"\\u0000"}]}')
        + DONE,
        False,
        True,
    ),
    "repeated-and-distinct-texts": (
        b"".join(_event(_text(t)) for t in ["a", "b", "a", " the", "b", "\u00e9", "a"]) + DONE,
        False,
        True,
    ),
    "usage-so-far": (
        _event({"choices": [{"text": "ab"}], "usage": {"completion_tokens": 2}})
        + _event({"choices": [{"text": "c"}], "usage": {"completion_tokens": 3}})
        + _event(
            {"choices": [{"text": "", "finish_reason": "stop"}], "usage": {"completion_tokens": 4}}
        )
        + DONE,
        False,
        True,
    ),
    "usage-so-far-with-held-back-utf8": (  # tokens in events without text, usage growing
        _event({"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}})
        + _event({"choices": [{"text": ""}], "usage": {"completion_tokens": 2}})
        + _event({"choices": [{"text": None}], "usage": {"completion_tokens": 3}})
        + _event({"choices": [{"text": "\u00e9"}], "usage": {"completion_tokens": 4}})
        + _event({"choices": [], "usage": {"completion_tokens": 4}})
        + DONE,
        False,
        True,
    ),
    "chat-usage-so-far-with-held-back-utf8": (
        _event({"choices": [{"delta": {"role": "assistant"}}], "usage": {"completion_tokens": 0}})
        + _event({"choices": [{"delta": {"content": "a"}}], "usage": {"completion_tokens": 1}})
        + _event({"choices": [{"delta": {"content": ""}}], "usage": {"completion_tokens": 3}})
        + _event({"choices": [{"delta": {}}], "usage": {"completion_tokens": 4}})
        + _event({"choices": [{"delta": {"content": "\u6771"}}], "usage": {"completion_tokens": 5}})
        + DONE,
        True,
        True,
    ),
    "usage-so-far-shrinking-and-negative": (
        _event({"choices": [{"text": "ab"}], "usage": {"completion_tokens": 5}})
        + _event({"choices": [{"text": "c"}], "usage": {"completion_tokens": -1}})
        + DONE,
        False,
        True,
    ),
    "usage-on-some-text-events-only": (
        _event({"choices": [{"text": "ab"}], "usage": {"completion_tokens": 2}})
        + _event(_text("c"))
        + DONE,
        False,
        True,
    ),
    "usage-completion-not-an-int": (
        _event({"choices": [{"text": "a"}], "usage": {"completion_tokens": 2.0}})
        + _event({"choices": [{"text": "b"}], "usage": {"completion_tokens": True}})
        + _event({"choices": [{"text": "c"}], "usage": {"completion_tokens": "3"}})
        + DONE,
        False,
        True,
    ),
    "usage-completion-18-digits": (
        _event({"choices": [{"text": "a"}], "usage": {"completion_tokens": 10**17 + 5}}) + DONE,
        False,
        True,
    ),
    "usage-completion-19-digits": (
        _event({"choices": [{"text": "a"}], "usage": {"completion_tokens": 10**18 + 5}}) + DONE,
        False,
        False,
    ),
    "usage-empty-null-then-real": (
        _event({"choices": [{"text": "a"}], "usage": {}})
        + _event({"choices": [], "usage": None})
        + USAGE
        + DONE,
        False,
        True,
    ),
    "usage-a-string": (_event({"choices": [{"text": "a"}], "usage": "lots"}) + DONE, False, False),
    "token-ids": (
        _event({"choices": [{"text": "ab", "token_ids": [5, 6]}]})
        + _event({"choices": [{"text": "c", "token_ids": []}]})
        + _event({"choices": [{"text": "", "token_ids": [7], "finish_reason": "stop"}]})
        + DONE,
        False,
        True,
    ),
    "token-ids-on-events-without-text": (
        _event({"choices": [{"text": "a", "token_ids": [5]}]})
        + _event({"choices": [{"text": "", "token_ids": [6, 7]}]})
        + _event({"choices": [{"text": "b", "token_ids": [8]}]})
        + _event({"choices": [{"text": ""}]})
        + DONE,
        False,
        True,
    ),
    "token-ids-not-a-list": (
        _event({"choices": [{"text": "ab", "token_ids": {"a": 1}}]}) + DONE,
        False,
        True,
    ),
    "token-ids-on-some-events": (
        _event({"choices": [{"text": "ab", "token_ids": [5, 6]}]}) + _event(_text("c")) + DONE,
        False,
        True,
    ),
    "duplicate-keys-last-wins": (
        _event(b'{"id":"a","id":"b","choices":[{"text":"x","text":"yz"}],"choices":[{"text":"w"}]}')
        + _event(b'{"id":5,"choices":[{"text":"q","finish_reason":"stop","finish_reason":null}]}')
        + DONE,
        False,
        True,
    ),
    "id-not-a-string-first": (
        _event({"id": 7, "choices": [{"text": "a"}]})
        + _event({"id": "second", "choices": []})
        + _event({"id": "third"})
        + DONE,
        False,
        True,
    ),
    "escaped-keys": (
        _event(b'{"\\u0069d":"e","ch\\u006fices":[{"t\\u0065xt":"k","\\u0074ext\\u0000":"no"}]}')
        + DONE,
        False,
        True,
    ),
    "long-and-unicode-keys": (
        _event(
            {"x" * 40: 1, "caf\u00e9": [1, {"a": None}], "choices": [{"text": "a", "y" * 33: "b"}]}
        )
        + DONE,
        False,
        True,
    ),
    "every-json-value-elsewhere": (
        _event(
            {
                "object": [True, False, None, 0, -0.5, 1e-7, 2.5e10, -12, "s", [], {}],
                "choices": [{"logprobs": {"top": [{"a": -1.25e-05}]}, "text": "a", "index": 3}],
            }
        )
        + DONE,
        False,
        True,
    ),
    "whitespace-inside-events": (
        b'data:  { "choices" : [ { "text" : "a" } ] , "id" :\t"w" } \n\n' + DONE,
        False,
        True,
    ),
    "several-choices-first-read": (
        _event({"choices": [{"text": "first"}, {"text": "second"}, 3]}) + DONE,
        False,
        True,
    ),
    "empty-and-null-choices-and-no-choices": (
        _event({"choices": []})
        + _event({"choices": None})
        + _event({"id": "z"})
        + _event(_text("a"))
        + DONE,
        False,
        True,
    ),
    "finish-reason-empty-string": (
        _event(_text("a", finish_reason="stop")) + _event(_text("", finish_reason="")) + DONE,
        False,
        True,
    ),
    "only-done": (DONE, False, True),
    "no-done": (_event(_text("a")) + _event(_text("b")), False, True),
    "nesting-at-the-limit": (
        _event(b'{"x":' + b"[" * 62 + b"]" * 62 + b',"choices":[{"text":"a"}]}') + DONE,
        False,
        True,
    ),
    "nesting-past-the-limit": (
        _event(b'{"x":' + b"[" * 70 + b"]" * 70 + b',"choices":[{"text":"a"}]}') + DONE,
        False,
        False,
    ),
    # Everything below is the Python parser's to decide.
    "finish-reason-a-number": (_event(_text("a", finish_reason=1)) + DONE, False, False),
    "text-a-number": (_event({"choices": [{"text": 5}]}) + DONE, False, False),
    "text-false": (_event({"choices": [{"text": False}]}) + DONE, False, False),
    "choices-an-object": (_event({"choices": {"text": "a"}}) + DONE, False, False),
    "choices-first-not-an-object": (_event({"choices": ["a"]}) + DONE, False, False),
    "error-event": (
        _event(_text("a")) + _event({"error": {"message": "boom"}}) + DONE,
        False,
        False,
    ),
    "not-an-object": (b"data: [1, 2]\n\n" + DONE, False, False),
    "bad-json": (b"data: {oops\n\n" + DONE, False, False),
    "trailing-comma": (b'data: {"choices":[],}\n\n' + DONE, False, False),
    "two-values": (b'data: {"choices":[]} {"choices":[]}\n\n' + DONE, False, False),
    "leading-zero": (b'data: {"n":01,"choices":[]}\n\n' + DONE, False, False),
    "lone-high-surrogate": (_event(b'{"choices":[{"text":"\\ud800"}]}') + DONE, False, False),
    "lone-low-surrogate": (_event(b'{"choices":[{"text":"\\udc00x"}]}') + DONE, False, False),
    "bad-escape": (_event(b'{"choices":[{"text":"\\x41"}]}') + DONE, False, False),
    "raw-tab-in-a-string": (_event(b'{"choices":[{"text":"a\tb"}]}') + DONE, False, False),
    "invalid-utf8": (_event(b'{"choices":[{"text":"\xc3\x28"}]}') + DONE, False, False),
    "overlong-utf8": (_event(b'{"choices":[{"text":"\xc0\xaf"}]}') + DONE, False, False),
    "utf8-surrogate": (_event(b'{"choices":[{"text":"\xed\xa0\x80"}]}') + DONE, False, False),
    "a-number-too-big-for-a-double": (b'data: {"n":1e309,"choices":[]}\n\n' + DONE, False, False),
    "data-after-done": (_event(_text("a")) + DONE + _event(_text("late")), False, False),
    "comment": (b": ping\n\n" + _event(_text("a")) + DONE, False, False),
    "blank-event": (_event(_text("a")) + b"\n\n" + _event(_text("b")) + DONE, False, False),
    "crlf": ((_event(_text("a")) + DONE).replace(b"\n", b"\r\n"), False, False),
    "data-without-a-space": (b'data:{"choices":[{"text":"a"}]}\n\n' + DONE, False, False),
    "event-field": (b"event: message\n" + _event(_text("a")) + DONE, False, False),
    "cut-inside-an-event": (_event(_text("a")) + b'data: {"choi', False, False),
    "done-with-a-space": (_event(_text("a")) + b"data: [DONE] \n\n", False, False),
}


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_the_scanner_and_the_python_parser_agree(name, monkeypatch):
    blob, chat, scanner_takes_it = STREAMS[name]
    took = _agree(blob, chat, monkeypatch)
    assert took is scanner_takes_it, f"the scanner {'took' if took else 'refused'} {name!r}"


def test_event_times_are_the_reads_that_complete_them():
    blob = _event(_text("He")) + _event(_text("llo")) + DONE
    first = len(_event(_text("He")))
    # read 1 ends one byte before the first event's second newline, read 2 ends on it
    reads = [(10, blob[: first - 1]), (20, blob[first - 1 : first]), (30, blob[first:])]
    parsed = sse.parse_stream(reads, chat=False)
    assert sse_native.scan(reads, chat=False) is not None
    assert parsed.chunks == [(20, 1, 2), (30, 1, 3)]


json_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6
)  # any code point but lone surrogates
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    json_text,
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(json_text, inner, max_size=3),
    max_leaves=8,
)
choice = st.fixed_dictionaries(
    {},
    optional={
        "text": st.one_of(json_text, st.none()),
        "delta": st.one_of(
            st.fixed_dictionaries(
                {}, optional={"content": st.one_of(json_text, st.none()), "role": json_text}
            ),
            json_value,
        ),
        "finish_reason": st.one_of(st.none(), st.sampled_from(["stop", "length", ""])),
        "token_ids": st.one_of(st.lists(st.integers(0, 50_000), max_size=4), json_value),
        "index": st.integers(0, 3),
        "logprobs": json_value,
    },
)
event = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(json_text, json_value),
        "choices": st.one_of(st.lists(choice, min_size=1, max_size=2), st.just([]), st.none()),
        "usage": st.one_of(
            st.none(),
            st.fixed_dictionaries(
                {},
                optional={
                    "completion_tokens": st.one_of(st.integers(-5, 10**6), json_value),
                    "prompt_tokens": st.integers(0, 99),
                },
            ),
        ),
        "object": json_value,
    },
)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(event, max_size=8),
    done=st.booleans(),
    chat=st.booleans(),
    ascii_only=st.booleans(),
    cut=st.integers(1, 50),
)
def test_random_streams_parse_alike(events, done, chat, ascii_only, cut):
    blob = b"".join(
        b"data: " + json.dumps(e, ensure_ascii=ascii_only).encode() + b"\n\n" for e in events
    ) + (DONE if done else b"")
    if not blob:
        return
    assert_parse_alike(blob, chat, cut)


def assert_parse_alike(blob: bytes, chat: bool, cut: int) -> None:
    """The scanner and the Python parser give the same parse of `blob`, read whole and in
    reads of `cut` bytes (no monkeypatch: Hypothesis tests call it once per example)."""
    for sizes in ([len(blob)], [cut] * (len(blob) // cut + 1)):
        reads = _reads(blob, sizes)
        native = sse.parse_stream(reads, chat=chat)
        sse_native._tried, saved = True, sse_native._lib
        sse_native._lib = None  # no scanner: the Python parser
        try:
            python = sse.parse_stream(reads, chat=chat)
        finally:
            sse_native._lib = saved
        assert native == python


def _raw(reads) -> RawResult:
    return RawResult("r1", False, 0, t_sent_ns=500, t_first_byte_ns=900, t_done_ns=9_000,
                     http_status=200, reads=reads)  # fmt: skip


@pytest.mark.parametrize("tokenizer", [None, "chars"])
def test_records_and_chunk_rows_are_the_same_either_way(tokenizer, monkeypatch):
    blob, _, _ = STREAMS["repeated-and-distinct-texts"]
    reads = _reads(blob, [11])
    count = (lambda text: len(text)) if tokenizer else None
    native = to_rows(_raw(reads), 4, RecordContext(t0_ns=100, is_chat=False, count_tokens=count))
    with monkeypatch.context() as m:
        m.setattr(sse_native, "scan", lambda _reads, chat: None)
        python = to_rows(
            _raw(reads), 4, RecordContext(t0_ns=100, is_chat=False, count_tokens=count)
        )
    assert native[0] == python[0]
    assert native[1].rows() == python[1].rows()
    if tokenizer:  # retokenised: " the" is 4 characters, so 4 tokens
        assert [n for _, _, n, _ in native[1].rows()] == [1, 1, 1, 4, 1, 1, 1]


def test_switched_off_by_the_environment():
    code = (
        "from harness.http import sse_native; "
        "print(sse_native.available(), sse_native.scan([(1, b'data: {}\\n\\n')], chat=False))"
    )
    env = {"BENCH_NATIVE_SSE": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "None"], out.stderr


def test_usage_and_ids_are_decoded_from_their_spans():
    blob = (
        _event({"id": 'cmpl-\u00e9"q', "choices": [{"text": "a", "finish_reason": "st\u00f6p"}]})
        + _event(
            {
                "choices": [],
                "usage": {"completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 3}},
            }
        )
        + DONE
    )
    scanned = sse_native.scan(_reads(blob, [len(blob)]), chat=False)
    assert scanned is not None
    assert orjson.loads(scanned.response_id) == 'cmpl-\u00e9"q'
    parsed = sse.parse_stream(_reads(blob, [len(blob)]), chat=False)
    assert parsed.response_id == 'cmpl-\u00e9"q' and parsed.finish_reason == "st\u00f6p"
    assert parsed.usage == {"completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 3}}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_run_records_the_same_with_and_without_the_scanner(
    mock_server, tmp_path, endpoint, monkeypatch
):
    """Through the CLI, against the harness's mock: every request's counts, text hash and
    chunk rows (times aside: two runs) are the same whichever parser read the streams."""
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from harness.cli import bench

    args = ["--workload", "random", "--tokenizer", "tiny-random", "--input-len", "4",
            "--output-len", "40", "--num-requests", "6", "--concurrency", "3", "--quiet",
            "--endpoint", endpoint, "--seed", "3"]  # fmt: skip
    tables, scanned = {}, {"1": 0, "0": 0}
    real_scan = sse_native.scan

    def counting_scan(reads, chat):
        out = real_scan(reads, chat=chat)
        scanned[os.environ.get("BENCH_NATIVE_SSE", "1")] += out is not None
        return out

    monkeypatch.setattr(sse_native, "scan", counting_scan)
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        for env in ("1", "0"):
            out = tmp_path / f"native-{env}"
            result = CliRunner().invoke(
                bench,
                ["run", "--url", url, *args, "--out", str(out)],
                env={"BENCH_NATIVE_SSE": env},
            )
            assert result.exit_code == 0, result.output
            tables[env] = (
                pq.read_table(out / "requests.parquet"),
                pq.read_table(out / "chunks.parquet"),
            )
    keep = ["request_id", "status", "output_tokens", "client_output_tokens", "output_chars",
            "output_sha256", "num_chunks", "finish_reason", "chunk_tokens_source",
            "output_tokens_source"]  # fmt: skip
    assert scanned == {
        "1": 6,
        "0": 0,
    }  # the scanner read every stream of one run, none of the other
    native, python = tables["1"], tables["0"]

    def by_id(table):
        return sorted(zip(*(table[c].to_pylist() for c in table.column_names), strict=True))

    assert by_id(native[0].select(keep)) == by_id(python[0].select(keep))
    assert set(native[0]["status"].to_pylist()) == {"ok"}
    cols = ["request_id", "n_tokens", "n_chars"]
    assert by_id(native[1].select(cols)) == by_id(python[1].select(cols))
    assert native[1].num_rows >= 6 * 40
