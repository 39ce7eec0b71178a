"""Grammar-constrained decoding: a request's `GuidedDecoding` (a JSON schema, any JSON object, a
regular expression, a list of choices or an EBNF grammar) becomes a token mask per step.

The library is xgrammar (the `grammar` extra), chosen by speed on this CPU: on SmolLM2's 49,152
tokens and a five-field JSON schema, `benchmarks/grammar.py --scenarios libraries --rounds 5`
measured setup (vocabulary and compile) 358 ms and a step's mask 0.007 ms on average, against
540 ms and 0.083 ms for llguidance and 2,002 ms and 0.031 ms for outlines-core; it also rolls
back and forks matchers natively. It is imported on first use only (about 2 s here: it imports
transformers), so an engine that never sees a constrained request never loads it.

The engine keeps one `GrammarMatcher` per constrained sequence. It advances with committed
tokens only (`accept`); to verify a speculative draft the engine walks the matcher through the
drafted tokens to fill each verified position's mask and rolls the walk back before anything
is committed (`draft_masks`), so a rejected draft never reaches the grammar's state.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
INSTALL_HINT = "pip install 'llm-bench-harness[grammar]'"
# Bounds on what one request may ask the compiler to do.
MAX_GUIDED_CHARS = 65_536
MAX_CHOICES = 1024


class GrammarError(ValueError):
    """A constraint that cannot be used: invalid, or the library is missing; one sentence."""


@dataclass(frozen=True)
class GuidedDecoding:
    """One request's output constraint. `kind` "json": `spec` is a JSON schema (JSON text);
    "json_object": any JSON object (`spec` unused); "regex": `spec` is a regular expression the
    whole output must match; "choice": the output is exactly one of `choices`; "grammar":
    `spec` is an EBNF grammar with a `root` rule (xgrammar's GBNF dialect, as llama.cpp's)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise GrammarError(
                f"Unknown guided decoding kind {self.kind!r}; use one of {', '.join(GUIDED_KINDS)}."
            )
        if not isinstance(self.spec, str):
            raise GrammarError(f"The {self.kind} constraint must be a string.")
        if len(self.spec) > MAX_GUIDED_CHARS:
            raise GrammarError(
                f"The {self.kind} constraint has {len(self.spec)} characters; at most "
                f"{MAX_GUIDED_CHARS} are allowed."
            )
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise GrammarError("guided_choice must be a non-empty list of non-empty strings.")
            if len(self.choices) > MAX_CHOICES:
                raise GrammarError(
                    f"guided_choice has {len(self.choices)} choices; at most {MAX_CHOICES} "
                    "are allowed."
                )
        elif self.kind != "json_object" and not self.spec:
            raise GrammarError(f"The {self.kind} constraint must not be empty.")

    @classmethod
    def json_schema(cls, schema: Any) -> GuidedDecoding:
        """From a schema object (a dict or bool) or its JSON text."""
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise GrammarError(
            f"Guided decoding needs the xgrammar library, which is not installed ({INSTALL_HINT})."
        ) from None
    return xgrammar


def grammar_available() -> bool:
    try:
        _xgrammar()
    except GrammarError:
        return False
    return True


# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: " and may add "Check failed: ...".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def _error_sentence(guided: GuidedDecoding, exc: Exception) -> str:
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    detail = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", detail)).rstrip(".")
    what = {
        "json": "JSON schema",
        "json_object": "JSON object grammar",
        "regex": "regular expression",
        "choice": "choice list",
        "grammar": "grammar",
    }[guided.kind]
    return f"The {what} cannot be used for guided decoding: {detail}."


def _choice_ebnf(choices: Sequence[str]) -> str:
    # JSON string escapes are EBNF string escapes in xgrammar's dialect.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _grammar(xgr: Any, guided: GuidedDecoding) -> Any:
    if guided.kind == "json":
        return xgr.Grammar.from_json_schema(guided.spec, any_whitespace=False, strict_mode=True)
    if guided.kind == "json_object":
        return xgr.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False
        )
    if guided.kind == "regex":
        return xgr.Grammar.from_regex(guided.spec)
    if guided.kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(guided.choices))
    return xgr.Grammar.from_ebnf(guided.spec)


@functools.lru_cache(maxsize=256)
def check_guided(guided: GuidedDecoding) -> None:
    """Raise GrammarError (one sentence naming the problem) when `guided` cannot be compiled;
    needs no tokenizer, so the server checks requests before they reach the engine."""
    xgr = _xgrammar()
    try:
        _grammar(xgr, guided)
    except Exception as exc:  # xgrammar raises RuntimeError and its own kinds
        raise GrammarError(_error_sentence(guided, exc)) from None


# GPT-2's byte-level alphabet: each byte is one printable character in the vocabulary.
def _byte_decoder() -> dict[str, int]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer: Any, vocab_size: int | None = None) -> list[bytes]:
    """The bytes each token id stands for, `vocab_size` entries (the model's logits may cover
    more ids than the tokenizer has). Special tokens and ids without a token are b"", which
    the grammar never allows (end-of-sequence ids are allowed where the grammar may end).
    Raises GrammarError for a tokenizer that is not byte-level BPE."""
    from tokenizers import decoders

    backend = tokenizer.backend
    if not isinstance(backend.decoder, decoders.ByteLevel):
        raise GrammarError(
            f"Guided decoding supports byte-level BPE tokenizers; {tokenizer.name!r} is not one."
        )
    size = max(vocab_size or 0, tokenizer.vocab_size)
    added = backend.get_added_tokens_decoder()
    out: list[bytes] = []
    for token_id in range(size):
        if token_id in added:
            token = added[token_id]
            out.append(b"" if token.special else token.content.encode("utf-8"))
            continue
        piece = backend.id_to_token(token_id)
        if piece is None or any(c not in _BYTE_DECODER for c in piece):
            out.append(b"")
        else:
            out.append(bytes(_BYTE_DECODER[c] for c in piece))
    return out


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, backend: GrammarBackend) -> None:
        self._matcher = matcher
        self._backend = backend

    def accept(self, token_id: int) -> None:
        """Advance by a committed token; GrammarError when the grammar does not allow it."""
        if not self._matcher.accept_token(token_id):
            raise GrammarError(f"token {token_id} is not allowed by the request's grammar")

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted an end-of-sequence token: the output is complete."""
        return bool(self._matcher.is_terminated())

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.fork(), self._backend)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def draft_masks(
        self, bitmask: torch.Tensor, first_row: int, draft: Sequence[int], parents: Any = None
    ) -> None:
        """Fill rows `first_row` (after the committed tokens) and `first_row + 1 + i` (after
        draft node i and its ancestors) and leave the matcher where it was. `parents` None
        is a chain; else a token tree's parents (see `DraftTree`). A node below a token the
        grammar rejects gets an all-allowed row: verification never reaches it, since its
        ancestor's row masks that token out."""
        self.fill(bitmask, first_row)
        if parents is None:
            parents = [None, *range(len(draft) - 1)] if draft else []
        for node in range(len(draft)):
            path = []
            at: int | None = node
            while at is not None:
                path.append(draft[at])
                at = parents[at]
            path.reverse()
            accepted = 0
            try:
                for token in path:
                    if not self._matcher.accept_token(token):
                        break
                    accepted += 1
                if accepted == len(path):
                    self.fill(bitmask, first_row + 1 + node)
                else:
                    bitmask[first_row + 1 + node] = -1
            finally:
                if accepted:
                    self._matcher.rollback(accepted)

    def debug_state(self) -> str:
        """The library's rendering of the parser state (tests compare two matchers by it)."""
        return str(self._matcher._debug_print_internal_state())


class GrammarBackend:
    """The compiler for one tokenizer: its vocabulary as bytes, given to xgrammar once, and
    a cache of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        xgr = _xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        vocab = token_bytes(tokenizer, vocab_size)
        self.info = xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)

    def matcher(self, guided: GuidedDecoding) -> GrammarMatcher:
        """A matcher at the start of `guided`; GrammarError when it cannot be compiled."""
        try:
            grammar = _grammar(self._xgr, guided)
            compiled = self.compiler.compile_grammar(grammar)
        except Exception as exc:
            raise GrammarError(_error_sentence(guided, exc)) from None
        return GrammarMatcher(self._xgr.GrammarMatcher(compiled), self)

    def allocate(self, rows: int) -> torch.Tensor:
        """A bitmask [rows, ceil(V / 32)] int32 with every token allowed."""
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set to -inf, in place, the logits of `rows` that `bitmask`'s same rows disallow."""
        if rows:
            self._xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device), vocab_size=self.vocab_size, indices=rows
            )
