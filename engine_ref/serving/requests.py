"""Request side of the OpenAI wire protocol: a JSON body becomes a validated
`GenerationRequest` (prompt token ids plus `SamplingParams`), or an `ApiError` whose OpenAI
error body names the offending field.

Pure functions; nothing here touches the network or the engine loop. Supported fields (others
are ignored, as OpenAI-compatible servers do): `model`, `prompt` (completions: a string, a list
of token ids, or a list of either) or `messages` (chat), `max_tokens` (chat also
`max_completion_tokens`), `n`, `temperature`, `top_p`, `top_k`, `seed`, `stop`,
`stop_token_ids`, `ignore_eos`, `min_tokens`, `logprobs`, `top_logprobs` (chat), `priority`,
`stream`, `stream_options.include_usage`, and `return_token_ids` (vLLM extension: each choice
and chunk carries the token ids it adds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine_ref.serving.errors import ApiError
from engine_ref.serving.fields import (
    check_encodable,
    int_list,
    optional_bool,
    optional_int,
    optional_number,
    stop_strings,
)
from engine_ref.serving.interface import EngineConfigError, SamplingParams, ServedTokenizer

_MAX_N = 64
_MAX_LOGPROBS = 20
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class GenerationRequest:
    """One validated /v1/completions or /v1/chat/completions request.

    `prompts` holds one token-id list per prompt; each becomes one engine request with `params`
    (whose `n` samples become choices `prompt_index * n + sample_index`). `logprobs` is the
    number of alternatives per token (0 = only the sampled token's), None for no logprobs.
    """

    model: str
    prompts: tuple[tuple[int, ...], ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    return_token_ids: bool

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None


def decode_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; ApiError 400 for invalid UTF-8, malformed JSON, a
    non-object, or strings holding lone surrogates (which are not encodable text)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"Request body is not valid UTF-8 (byte {exc.start}).") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(
            400, f"Request body is not valid JSON: {exc.msg} at position {exc.pos}."
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object.")
    return body


def parse_completion_request(
    body: dict[str, Any], *, tokenizer: ServedTokenizer, served_model: str, max_model_len: int
) -> GenerationRequest:
    """Validate a /v1/completions body; raises ApiError with status 400 or 404."""
    _check_model(body, served_model)
    prompts = _completion_prompts(body.get("prompt"), tokenizer)
    logprobs = optional_int(body, "logprobs", low=0, high=_MAX_LOGPROBS)
    if optional_bool(body, "echo"):
        raise ApiError(400, "echo is not supported by this server.", param="echo")
    best_of = optional_int(body, "best_of", low=1)
    if best_of is not None and best_of > 1:
        raise ApiError(400, "best_of is not supported by this server.", param="best_of")
    max_tokens = optional_int(body, "max_tokens", low=1)
    return _build(
        body,
        served_model=served_model,
        prompts=prompts,
        max_tokens=max_tokens,
        logprobs=logprobs,
        max_model_len=max_model_len,
    )


def parse_chat_request(
    body: dict[str, Any], *, tokenizer: ServedTokenizer, served_model: str, max_model_len: int
) -> GenerationRequest:
    """Validate a /v1/chat/completions body and render its messages with the model's chat
    template; raises ApiError with status 400 or 404."""
    _check_model(body, served_model)
    messages = _chat_messages(body.get("messages"))
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as exc:  # the tokenizer's ChatTemplateError is a ValueError
        raise ApiError(400, str(exc), param="messages") from None
    prompt = tuple(tokenizer.encode(text))
    logprobs = None
    if optional_bool(body, "logprobs"):
        logprobs = optional_int(body, "top_logprobs", low=0, high=_MAX_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        optional_int(body, "top_logprobs", low=0, high=_MAX_LOGPROBS)
        raise ApiError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
    max_tokens = optional_int(body, "max_completion_tokens", low=1)
    if max_tokens is None:
        max_tokens = optional_int(body, "max_tokens", low=1)
    return _build(
        body,
        served_model=served_model,
        prompts=(prompt,),
        max_tokens=max_tokens,
        logprobs=logprobs,
        max_model_len=max_model_len,
    )


def _build(
    body: dict[str, Any],
    *,
    served_model: str,
    prompts: tuple[tuple[int, ...], ...],
    max_tokens: int | None,
    logprobs: int | None,
    max_model_len: int,
) -> GenerationRequest:
    longest = max(len(p) for p in prompts)
    if max_tokens is None:
        max_tokens = max_model_len - longest
    if longest + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but you requested "
            f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
            "completion); reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    n = optional_int(body, "n", low=1, high=_MAX_N)
    temperature = optional_number(body, "temperature", low=0.0)
    top_p = optional_number(body, "top_p")
    top_k = optional_int(body, "top_k", low=-1)
    seed = optional_int(body, "seed")
    min_tokens = optional_int(body, "min_tokens", low=0)
    kwargs: dict[str, Any] = {
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": stop_strings(body.get("stop")),
        "stop_token_ids": int_list(body, "stop_token_ids"),
        "ignore_eos": optional_bool(body, "ignore_eos"),
        "logprobs": logprobs,
        "min_tokens": min_tokens,
    }
    try:
        params = SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except EngineConfigError as exc:
        raise ApiError(400, str(exc)) from None
    stream = bool(optional_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object.", param="stream_options")
        include_usage = bool(optional_bool(options, "include_usage"))
    return GenerationRequest(
        model=served_model,
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=include_usage,
        priority=optional_int(body, "priority") or 0,
        return_token_ids=bool(optional_bool(body, "return_token_ids")),
    )


def _check_model(body: dict[str, Any], served_model: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string.", param="model")
    if model != served_model:
        raise ApiError(
            404,
            f"The model {model!r} does not exist; this server serves {served_model!r}.",
            param="model",
            code="model_not_found",
        )


def _completion_prompts(prompt: Any, tokenizer: ServedTokenizer) -> tuple[tuple[int, ...], ...]:
    if prompt is None:
        raise ApiError(400, "prompt is required.", param="prompt")
    if isinstance(prompt, str) or _is_token_list(prompt):
        items = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or _is_token_list(p) for p in prompt)
    ):
        items = prompt
    else:
        raise ApiError(
            400,
            "prompt must be a string, a list of token ids, or a non-empty list of either.",
            param="prompt",
        )
    vocab_size = tokenizer.vocab_size
    prompts = []
    for item in items:
        if isinstance(item, str):
            check_encodable(item, "prompt")
            ids = tuple(tokenizer.encode(item))
        else:
            if any(not 0 <= t < vocab_size for t in item):
                raise ApiError(
                    400, f"prompt token ids must be in [0, {vocab_size}).", param="prompt"
                )
            ids = tuple(item)
        if not ids:
            raise ApiError(400, "prompt must not be empty.", param="prompt")
        prompts.append(ids)
    return tuple(prompts)


def _is_token_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _chat_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list.", param="messages")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object.", param="messages")
        role = message.get("role")
        if role not in _CHAT_ROLES:
            raise ApiError(
                400,
                f"messages[{i}].role must be one of {', '.join(sorted(_CHAT_ROLES))}.",
                param="messages",
            )
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise ApiError(
                        400, f"messages[{i}].content parts must be text parts.", param="messages"
                    )
                text = part.get("text")
                if not isinstance(text, str):
                    raise ApiError(
                        400, f"messages[{i}] text part needs a string.", param="messages"
                    )
                parts.append(text)
            content = "".join(parts)
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string.", param="messages")
        check_encodable(content, "messages")
        rendered.append({"role": role, "content": content})
    return rendered
