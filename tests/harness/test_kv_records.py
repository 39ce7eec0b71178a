"""A P/D cluster's `usage.kv_transfer` and `x-bench-worker` header into the request's columns
(`harness.load.kv_records`), through `to_rows` on a streamed and a whole answer: each field
read on its own, at and around each limit, and garbage (a string for a number, a boolean for a
count, a negative or absurd figure, a list for the object) leaves that column null, never a
failed request."""

from __future__ import annotations

import json

import pytest

from harness.http.client import RawResult
from harness.load.kv_records import MAX_BYTES, MAX_MS
from harness.load.records import RecordContext, to_rows
from slo.runrecord import RequestStatus

GOOD = {"transfer_id": "t1", "ok": True, "error": None, "bytes": 65536, "transfer_ms": 1.25,
        "prefill_ms": 12.5, "install_ms": 0.75, "worker": "prefill-0",
        "decode_worker": "decode-1", "retried": None}  # fmt: skip
NULLS = dict(kv_prefill_ms=None, kv_transfer_bytes=None, kv_transfer_ms=None, kv_install_ms=None,
             kv_transfer_ok=None, kv_transfer_retried=None, served_by=None)  # fmt: skip


def _usage(kv_transfer) -> dict:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    if kv_transfer is not _ABSENT:
        usage["kv_transfer"] = kv_transfer
    return usage


_ABSENT = object()


def _stream(usage: dict) -> list[tuple[int, bytes]]:
    events = [{"id": "c", "choices": [{"index": 0, "text": t, "finish_reason": None}]}
              for t in ("a", "b")]  # fmt: skip
    events.append({"id": "c", "choices": [], "usage": usage})
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return [(10, body + b"data: [DONE]\n\n")]


def _record(kv_transfer=_ABSENT, *, header: str | None = None, streamed: bool = True):
    usage = _usage(kv_transfer)
    raw = RawResult("r", False, 0, t_sent_ns=1, t_first_byte_ns=2, t_done_ns=20,
                    http_status=200, worker=header)  # fmt: skip
    if streamed:
        raw.reads = _stream(usage)
    else:
        answer = {"id": "c", "choices": [{"index": 0, "text": "ab", "finish_reason": "length"}],
                  "usage": usage}  # fmt: skip
        raw.body = json.dumps(answer).encode()
    record, _ = to_rows(raw, 3, RecordContext(t0_ns=0, is_chat=False))
    assert record.status is RequestStatus.OK  # whatever the extension says
    return {name: getattr(record, name) for name in NULLS}


@pytest.mark.parametrize("streamed", [True, False])
def test_a_good_extension_fills_every_column(streamed):
    assert _record(GOOD, streamed=streamed) == dict(
        kv_prefill_ms=12.5, kv_transfer_bytes=65536, kv_transfer_ms=1.25, kv_install_ms=0.75,
        kv_transfer_ok=True, kv_transfer_retried=None, served_by="decode-1",
    )  # fmt: skip


def test_a_target_that_says_nothing_leaves_every_column_null():
    assert _record() == NULLS
    assert _record(None) == NULLS


@pytest.mark.parametrize("garbage", [[GOOD], "ok", 7, True, {}])
def test_an_extension_that_is_not_an_object_or_is_empty_leaves_every_column_null(garbage):
    assert _record(garbage) == NULLS


@pytest.mark.parametrize(
    ("field", "value", "column", "expected"),
    [
        ("transfer_ms", 0, "kv_transfer_ms", 0.0),
        ("transfer_ms", 0.001, "kv_transfer_ms", 0.001),
        ("transfer_ms", -0.001, "kv_transfer_ms", None),
        ("transfer_ms", MAX_MS - 1, "kv_transfer_ms", MAX_MS - 1),
        ("transfer_ms", MAX_MS, "kv_transfer_ms", None),
        ("transfer_ms", 1e300, "kv_transfer_ms", None),
        ("transfer_ms", "1.25", "kv_transfer_ms", None),
        ("transfer_ms", True, "kv_transfer_ms", None),
        ("transfer_ms", None, "kv_transfer_ms", None),
        ("prefill_ms", [1.0], "kv_prefill_ms", None),
        ("prefill_ms", 7, "kv_prefill_ms", 7.0),
        ("install_ms", {"ms": 1}, "kv_install_ms", None),
        ("bytes", 0, "kv_transfer_bytes", 0),
        ("bytes", -1, "kv_transfer_bytes", None),
        ("bytes", MAX_BYTES - 1, "kv_transfer_bytes", MAX_BYTES - 1),
        ("bytes", MAX_BYTES, "kv_transfer_bytes", None),
        ("bytes", 4096.0, "kv_transfer_bytes", 4096),
        ("bytes", 4096.5, "kv_transfer_bytes", None),
        ("bytes", True, "kv_transfer_bytes", None),
        ("bytes", "65536", "kv_transfer_bytes", None),
        ("ok", False, "kv_transfer_ok", False),
        ("ok", 1, "kv_transfer_ok", None),
        ("ok", "true", "kv_transfer_ok", None),
        ("retried", "recompute", "kv_transfer_retried", "recompute"),
        ("retried", 1, "kv_transfer_retried", None),
        ("retried", "x" * 129, "kv_transfer_retried", None),
        ("retried", "", "kv_transfer_retried", None),
    ],
)
def test_each_field_is_read_on_its_own(field, value, column, expected):
    got = _record({**GOOD, field: value})
    assert got[column] == expected
    untouched = _record(GOOD)
    assert {k: v for k, v in got.items() if k != column} == {
        k: v for k, v in untouched.items() if k != column
    }


@pytest.mark.parametrize(
    ("extension", "header", "served_by"),
    [
        ({"decode_worker": "decode-1", "worker": "prefill-0"}, "replica-2", "decode-1"),
        ({"worker": "prefill-0"}, "replica-2", "replica-2"),
        ({"worker": "prefill-0"}, None, "prefill-0"),
        ({"decode_worker": "", "worker": 5}, "replica-2", "replica-2"),
        ({"decode_worker": ["d"]}, "bad\nname", None),
        (_ABSENT, "replica-0", "replica-0"),
        (_ABSENT, "w" * 128, "w" * 128),
        (_ABSENT, "w" * 129, None),
    ],
)
def test_the_serving_worker_decode_then_header_then_prefill(extension, header, served_by):
    assert _record(extension, header=header)["served_by"] == served_by
