"""The engine's tokenizer: a `tokenizers.Tokenizer` plus chat template and end-of-sequence ids."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import tokenizers

# Tokens that end a turn or a document in common chat vocabularies; any present in a vocabulary
# is treated as end-of-sequence alongside the model file's own eos id.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


class ChatTemplateError(ValueError):
    """The chat template raised (e.g. `raise_exception`) or could not be compiled."""


class Tokenizer:
    """Text <-> token ids for one model.

    `backend` is the `tokenizers.Tokenizer`; `chat_template` the Jinja source from the model
    file ("" when the model has none); `bos_token_id` the model's BOS token (whether `encode`
    adds it is up to the backend's post-processor); `eos_token_ids` every id that ends a
    generation, the model's own eos first. Instances pickle by value (the compiled template is
    rebuilt on first use after unpickling).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        name: str,
        chat_template: str = "",
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.name = name
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        for token_id in (
            *self.eos_token_ids,
            *([bos_token_id] if bos_token_id is not None else []),
        ):
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"special token id {token_id} outside vocabulary of {self.vocab_size}"
                )
        self.special_token_ids: frozenset[int] = frozenset(
            token_id
            for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        )
        self._compiled_template: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_compiled_template"] = None
        return state

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in `text` (e.g. "<|im_start|>") map to
        their ids. `add_special_tokens` adds what the model's post-processor adds (a BOS token
        for models that want one; nothing for SmolLM2)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        return [
            e.ids
            for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Byte sequences that do not form complete UTF-8 characters come out as
        U+FFFD, so incremental callers should decode a window and hold back a trailing U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id` (byte-level encoded), or None when out of range."""
        return self.backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template in
        a sandboxed Jinja environment, as Hugging Face does (trim_blocks, lstrip_blocks).
        Raises `ChatTemplateError` when the model has no template or the template raises."""
        if not self.chat_template:
            raise ChatTemplateError(f"Model {self.name!r} has no chat template.")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **extra,
        }
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja2 raises many kinds; the caller needs one
            raise ChatTemplateError(f"Chat template of {self.name!r} failed: {exc}.") from exc


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _compile_template(source: str) -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, indent=indent, ensure_ascii=False
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"Chat template does not compile: {exc}.") from exc


def eos_ids_for(backend: tokenizers.Tokenizer, primary: Sequence[int | None]) -> tuple[int, ...]:
    """The model's own eos ids first, then any well-known end token present in the vocabulary."""
    ids = [i for i in primary if i is not None]
    for token in END_TOKENS:
        token_id = backend.token_to_id(token)
        if token_id is not None:
            ids.append(token_id)
    return tuple(dict.fromkeys(ids))
