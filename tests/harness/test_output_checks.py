"""Per-request output checks through the record path (`harness.load.records.to_rows`): the oracle
comparison, the TEST06-style flags, `output_valid`, and the engine ids kept per request."""

from __future__ import annotations

import json

import pytest

from harness.http.client import RawResult
from harness.load.output_checks import Expectation, OutputChecks
from harness.load.records import RecordContext, to_rows
from slo.runrecord import OutputFlag


class WordTokenizer:
    """One token per word: the counts in these cases can be worked by hand."""

    def encode(self, text: str) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]


def _stream(words: list[str], usage: int | None, rid: str = "cmpl-1") -> list[tuple[int, bytes]]:
    events = [{"id": rid, "choices": [{"index": 0, "text": f" {w}"}]} for w in words]
    if usage is not None:
        events.append(
            {"id": rid, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": usage}}
        )
    body = (
        b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    )
    return [(1_000 + i, body[i * 40 : (i + 1) * 40]) for i in range(len(body) // 40 + 1)]


def _row(words, usage, *, reference="a b c d", ignore_eos=False, max_tokens=4, diverge_before=2):
    checks = OutputChecks(
        WordTokenizer(),
        {"r": Expectation(max_tokens, ignore_eos)},
        {"r": reference} if reference is not None else None,
        diverge_before=diverge_before,
    )
    raw = RawResult("r", False, 0, t_sent_ns=10, t_done_ns=5_000, http_status=200,
                    reads=_stream(words, usage), engine_request_id="req-42")  # fmt: skip
    record, _ = to_rows(raw, 3, RecordContext(t0_ns=0, is_chat=False, checks=checks))
    return record


def test_an_exact_output_is_valid_and_keeps_its_ids():
    r = _row(["a", "b", "c", "d"], 4)
    assert (r.output_exact_match, r.output_first_divergence, r.output_agreement) == (
        True,
        None,
        1.0,
    )
    assert r.output_valid is True and r.output_flags is None
    assert (r.response_id, r.engine_request_id) == ("cmpl-1", "req-42")


@pytest.mark.parametrize(
    ("words", "diverge_before", "first", "valid", "flags"),
    [
        (["a", "b", "x", "d"], 2, 2, True, set()),  # at the allowed position: recorded, not wrong
        (["a", "x", "c", "d"], 2, 1, False, {OutputFlag.DIVERGED}),  # just before it
        (["x", "b", "c", "d"], 2, 0, False, {OutputFlag.DIVERGED, OutputFlag.FIRST_TOKEN_DIFFERS}),
        (["x", "b", "c", "d"], 0, 0, True, {OutputFlag.FIRST_TOKEN_DIFFERS}),  # 0: never wrong
    ],
)
def test_divergence_before_the_position_is_wrong_output(words, diverge_before, first, valid, flags):
    r = _row(words, 4, diverge_before=diverge_before)
    assert r.output_first_divergence == first and r.output_valid is valid
    assert set((r.output_flags or "").split(",")) - {""} == {f.value for f in flags}
    assert r.output_agreement == 0.75


def test_ignore_eos_cut_short_is_flagged_and_wrong():
    r = _row(["a", "b", "c"], 3, reference=None, ignore_eos=True)
    assert r.output_flags == OutputFlag.SHORT_IGNORE_EOS.value and r.output_valid is False
    ok = _row(["a", "b", "c", "d"], 4, reference=None, ignore_eos=True)
    assert ok.output_flags is None and ok.output_valid is None  # nothing to compare with


@pytest.mark.parametrize(
    ("usage", "flagged"),
    [(4, False), (6, False), (7, True), (2, True), (3, True)],  # 3 < 4 token-bearing chunks
)
def test_usage_that_disagrees_with_the_stream_is_flagged(usage, flagged):
    r = _row(["a", "b", "c", "d"], usage, reference=None)
    assert (r.output_flags == OutputFlag.USAGE_MISMATCH.value) is flagged


def test_a_server_merging_tokens_into_one_event_is_not_flagged():
    # 3 events carrying 4 words: usage 4 agrees with the retokenised text
    r = _row(["a b", "c", "d"], 4, reference=None)
    assert r.output_flags is None


class CharTokenizer:
    """One token per character: disagrees with the server's word tokens on purpose."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize(
    ("usage", "flagged"),
    [(6, False), (8, False), (9, True), (20, True), (1, True)],  # slack 2 tokens; 1 < 2 events
)
def test_chunks_carrying_several_tokens_are_counted_by_their_token_ids(usage, flagged):
    """Two events of three words each (speculative decoding): the events say 2, the text
    retokenised by characters says 12, the token ids say 6; only when every one of those
    disagrees with usage (or usage is below the event count) is it a mismatch."""
    events = [{"id": "c", "choices": [{"index": 0, "text": t, "token_ids": [1, 2, 3]}]}
              for t in (" a b c", " d e f")]  # fmt: skip
    events.append(
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": usage}}
    )
    body = (
        b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    )
    raw = RawResult("r", False, 0, t_sent_ns=10, t_done_ns=5_000, http_status=200,
                    reads=[(1_000, body)])  # fmt: skip
    checks = OutputChecks(CharTokenizer(), {"r": Expectation(8, False)})
    record, chunks = to_rows(raw, 3, RecordContext(t0_ns=0, is_chat=False, checks=checks))
    assert [n for _, _, n, _ in chunks] == [3, 3, 0]
    assert record.client_output_tokens == 6 and record.chunk_tokens_source == "token_ids"
    assert (record.output_flags == OutputFlag.USAGE_MISMATCH.value) is flagged
