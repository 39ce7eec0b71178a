"""Fixtures: small tokenizers built with the `tokenizers` library (no model files needed)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from workloads.prompts import corpus_text

_TRAINING_TEXT = (
    "Numbers like 1990, 42 and 3.14 appear in text; so do e-mail addresses, URLs and code: "
    "def f(x): return x * 2. Quotes \"like this\" and 'that' matter, as do new\nlines and tabs."
)


class ByteBPE:
    """A byte-level BPE (GPT-2 style pre-tokenisation) with the tokenizer protocol."""

    def __init__(self, vocab_size: int, *, batch: bool, name: str) -> None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        # train on a shuffled-ish variant so corpus words split into several tokens
        tok.train_from_iterator([_TRAINING_TEXT, corpus_text()[::2]], trainer)
        self.backend = tok
        self.name = name
        if batch:
            self.encode_batch = lambda texts: [e.ids for e in tok.encode_batch(list(texts))]

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids))


class WordPieceLike:
    """A tokenizer whose decode does not round-trip word boundaries the GPT-2 way
    (Metaspace pre-tokeniser, as SentencePiece models): exercises the slow path."""

    def __init__(self) -> None:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False)
        tok.train_from_iterator([corpus_text(), _TRAINING_TEXT], trainer)
        self.backend = tok
        self.name = "test-metaspace"

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids))


@pytest.fixture(scope="session")
def bpe_tokenizer() -> ByteBPE:
    return ByteBPE(700, batch=True, name="test-bpe-700")


@pytest.fixture(scope="session")
def bpe_tokenizer_nobatch() -> ByteBPE:
    return ByteBPE(500, batch=False, name="test-bpe-500")


@pytest.fixture(scope="session")
def metaspace_tokenizer() -> WordPieceLike:
    return WordPieceLike()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The reference engine's tiny-random tokenizer (built in-process, no download)."""
    weights = pytest.importorskip("engine_ref.loading")
    return weights.load_tokenizer("tiny-random")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M's tokenizer (fetched once into the cache); used by slow tests."""
    weights = pytest.importorskip("engine_ref.loading")
    return weights.load_tokenizer("smollm2-135m")
