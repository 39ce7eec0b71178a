"""Incremental detokenisation: deltas concatenate to the full decode and never split a UTF-8
character (multi-byte characters that span tokens are held back until complete)."""

from __future__ import annotations

import pytest

from engine_ref.core.detokenizer import IncrementalDetokenizer
from engine_ref.loading.tiny_random import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.mark.parametrize(
    "text", ["Café 東京 😀 naïve", "plain ascii, with spaces  and\nnewlines", "😀😀😀", "Москва!"]
)
def test_deltas_concatenate_to_decode_and_never_hold_fffd(tok, text):
    prompt = tok.encode("Hello: ")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok.decode, prompt)
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == text
    assert detok.text == text


def test_multibyte_character_is_held_back_until_complete(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1 and tok.decode(ids[:1]).endswith("\ufffd")  # split across tokens
    detok = IncrementalDetokenizer(tok.decode, [])
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_flush_releases_an_incomplete_tail(tok):
    ids = tok.encode("a😀")
    detok = IncrementalDetokenizer(tok.decode, [])
    emitted = "".join(detok.add([i]) for i in ids[:-1])
    assert emitted == "a"
    assert detok.flush() == "\ufffd"  # the stream ended mid-character


def test_special_tokens_are_skipped(tok):
    eos = tok.eos_token_ids[0]
    detok = IncrementalDetokenizer(tok.decode, [])
    out = [detok.add([i]) for i in tok.encode("Hi") + [eos]]
    assert "".join(out) == "Hi" and out[-1] == ""


def test_long_streams_keep_a_bounded_window(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 40)
    detok = IncrementalDetokenizer(tok.decode, [])
    text = "".join(detok.add([i]) for i in ids)
    assert text == tok.decode(ids)
    assert len(detok._ids) < 80
