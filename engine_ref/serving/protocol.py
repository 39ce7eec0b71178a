"""OpenAI wire protocol for the reference server: request validation into engine calls, and the
response, stream-chunk and error bodies.

Pure functions and dataclasses; nothing here touches the network or the engine loop.
Supported request fields (others are ignored, as OpenAI-compatible servers do): `model`,
`prompt` (completions: a string, a list of token ids, or a list of either) or `messages` (chat),
`max_tokens` (chat also `max_completion_tokens`), `n`, `temperature`, `top_p`, `top_k`, `seed`,
`stop`, `stop_token_ids`, `ignore_eos`, `min_tokens`, `logprobs`, `top_logprobs` (chat),
`priority`, `stream`, `stream_options.include_usage`, and `return_token_ids` (vLLM extension:
each choice and chunk carries the token ids it adds).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from engine_ref.core.engine_config import EngineConfigError, SamplingParams

_MAX_N = 64
_MAX_LOGPROBS = 20
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class ApiError(Exception):
    """An error answered to the client with an OpenAI-style body; `message` is one sentence."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` as OpenAI sends it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class GenerationRequest:
    """One validated /v1/completions or /v1/chat/completions request.

    `prompts` holds one token-id list per prompt; each becomes one engine request with `params`
    (whose `n` samples become choices `prompt_index * n + sample_index`). `logprobs` is the
    number of alternatives per token (0 = only the sampled token's), None for no logprobs.
    """

    kind: str  # "completion" or "chat"
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
    body: dict[str, Any], *, tokenizer: Any, served_model: str, max_model_len: int
) -> GenerationRequest:
    """Validate a /v1/completions body; raises ApiError with status 400 or 404."""
    _check_model(body, served_model)
    prompts = _completion_prompts(body.get("prompt"), tokenizer)
    logprobs = _optional_int(body, "logprobs", low=0, high=_MAX_LOGPROBS)
    if _optional_bool(body, "echo"):
        raise ApiError(400, "echo is not supported by this server.", param="echo")
    best_of = _optional_int(body, "best_of", low=1)
    if best_of is not None and best_of > 1:
        raise ApiError(400, "best_of is not supported by this server.", param="best_of")
    max_tokens = _optional_int(body, "max_tokens", low=1)
    return _build(body, "completion", served_model, prompts, max_tokens, logprobs, max_model_len)


def parse_chat_request(
    body: dict[str, Any], *, tokenizer: Any, served_model: str, max_model_len: int
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
    if _optional_bool(body, "logprobs"):
        logprobs = _optional_int(body, "top_logprobs", low=0, high=_MAX_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        _optional_int(body, "top_logprobs", low=0, high=_MAX_LOGPROBS)
        raise ApiError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
    max_tokens = _optional_int(body, "max_completion_tokens", low=1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", low=1)
    return _build(body, "chat", served_model, (prompt,), max_tokens, logprobs, max_model_len)


def _build(
    body: dict[str, Any],
    kind: str,
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
    n = _optional_int(body, "n", low=1, high=_MAX_N)
    temperature = _optional_number(body, "temperature", low=0.0)
    top_p = _optional_number(body, "top_p")
    top_k = _optional_int(body, "top_k", low=-1)
    seed = _optional_int(body, "seed")
    min_tokens = _optional_int(body, "min_tokens", low=0)
    kwargs: dict[str, Any] = {
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": _stop_strings(body.get("stop")),
        "stop_token_ids": _int_list(body, "stop_token_ids"),
        "ignore_eos": _optional_bool(body, "ignore_eos"),
        "logprobs": logprobs,
        "min_tokens": min_tokens,
    }
    try:
        params = SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except EngineConfigError as exc:
        raise ApiError(400, str(exc)) from None
    stream = bool(_optional_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object.", param="stream_options")
        include_usage = bool(_optional_bool(options, "include_usage"))
    return GenerationRequest(
        kind=kind,
        model=served_model,
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=include_usage,
        priority=_optional_int(body, "priority") or 0,
        return_token_ids=bool(_optional_bool(body, "return_token_ids")),
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


def _completion_prompts(prompt: Any, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
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
            _check_encodable(item, "prompt")
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
        _check_encodable(content, "messages")
        rendered.append({"role": role, "content": content})
    return rendered


def _check_encodable(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, f"{param} contains invalid Unicode (a lone surrogate).", param=param
        ) from None


def _stop_strings(stop: Any) -> tuple[str, ...] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of them.", param="stop")
    for s in stop:
        _check_encodable(s, "stop")
    return tuple(stop)


def _int_list(body: dict[str, Any], name: str) -> tuple[int, ...] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ApiError(400, f"{name} must be a list of integers.", param=name)
    return tuple(value)


def _optional_int(
    body: dict[str, Any], name: str, *, low: int | None = None, high: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {json.dumps(value)}.", param=name)
    if low is not None and value < low:
        raise ApiError(400, f"{name} must be at least {low}, got {value}.", param=name)
    if high is not None and value > high:
        raise ApiError(400, f"{name} must be at most {high}, got {value}.", param=name)
    return value


def _optional_number(body: dict[str, Any], name: str, *, low: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a finite number, got {json.dumps(value)}.", param=name)
    if low is not None and value < low:
        raise ApiError(400, f"{name} must be at least {low}, got {value}.", param=name)
    return float(value)


def _optional_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {json.dumps(value)}.", param=name)
    return value


# ---- response bodies ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's logprob with its top alternatives, texts already decoded."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


class ChoiceAccumulator:
    """Everything one choice produced so far, plus what has not been streamed yet."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.num_output_tokens = 0
        self._pending_text: list[str] = []
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[TokenLogprob] = []
        self._finish_sent = False

    def add(
        self,
        new_text: str,
        new_token_ids: list[int],
        logprobs: list[TokenLogprob],
        finish_reason: str | None,
        num_output_tokens: int,
    ) -> None:
        self.text += new_text
        self.token_ids.extend(new_token_ids)
        self.logprobs.extend(logprobs)
        self._pending_text.append(new_text)
        self._pending_ids.extend(new_token_ids)
        self._pending_logprobs.extend(logprobs)
        self.num_output_tokens = num_output_tokens
        if finish_reason is not None:
            self.finish_reason = finish_reason

    def has_pending(self) -> bool:
        """Whether a chunk is due: new tokens (even when their text is empty: a special token,
        or a character still incomplete and held back) or an unsent finish reason. One chunk
        per engine output keeps chunk times equal to token times, as vLLM streams them."""
        return bool(self._pending_ids) or (self.finish_reason is not None and not self._finish_sent)

    def take_pending(self) -> tuple[str, list[int], list[TokenLogprob], str | None]:
        text = "".join(self._pending_text)
        ids, logprobs = self._pending_ids, self._pending_logprobs
        self._pending_text, self._pending_ids, self._pending_logprobs = [], [], []
        finish = None
        if self.finish_reason is not None and not self._finish_sent:
            finish, self._finish_sent = self.finish_reason, True
        return text, ids, logprobs, finish


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs_body(entries: list[TokenLogprob], text_offset_chars: int) -> dict[str, Any]:
    """The legacy completions `logprobs` object; offsets count characters from the start of
    the choice's text."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset_chars)
        text_offset_chars += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs_body(entries: list[TokenLogprob]) -> dict[str, Any]:
    """The chat `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in e.top
                ],
            }
            for e in entries
        ]
    }


def response_body(
    kind: str,
    response_id: str,
    created_s: int,
    model: str,
    choices: list[ChoiceAccumulator],
    usage: dict[str, int],
    *,
    with_logprobs: bool,
    with_token_ids: bool,
) -> dict[str, Any]:
    """A complete (non-streaming) `text_completion` or `chat.completion` body."""
    rendered = []
    for choice in choices:
        if kind == "completion":
            item: dict[str, Any] = {
                "index": choice.index,
                "text": choice.text,
                "logprobs": completion_logprobs_body(choice.logprobs, 0) if with_logprobs else None,
                "finish_reason": choice.finish_reason,
            }
        else:
            item = {
                "index": choice.index,
                "message": {"role": "assistant", "content": choice.text},
                "logprobs": chat_logprobs_body(choice.logprobs) if with_logprobs else None,
                "finish_reason": choice.finish_reason,
            }
        if with_token_ids:
            item["token_ids"] = list(choice.token_ids)
        rendered.append(item)
    return {
        "id": response_id,
        "object": "text_completion" if kind == "completion" else "chat.completion",
        "created": created_s,
        "model": model,
        "choices": rendered,
        "usage": usage,
    }


def chunk_body(
    kind: str,
    response_id: str,
    created_s: int,
    model: str,
    choice: ChoiceAccumulator,
    *,
    role: bool = False,
    with_logprobs: bool,
    with_token_ids: bool,
) -> dict[str, Any]:
    """One streamed chunk carrying what `choice` produced since its last chunk (`role`: the
    chat stream's opening chunk `delta: {"role": "assistant", "content": ""}` instead)."""
    if role:
        text, ids, entries, finish = "", [], [], None
    else:
        offset = len(choice.text) - sum(len(t) for t in choice._pending_text)
        text, ids, entries, finish = choice.take_pending()
    if kind == "completion":
        item: dict[str, Any] = {
            "index": choice.index,
            "text": text,
            "logprobs": completion_logprobs_body(entries, offset) if with_logprobs else None,
            "finish_reason": finish,
        }
    else:
        if role:
            delta: dict[str, Any] = {"role": "assistant", "content": ""}
        else:
            delta = {"content": text} if text or not finish else {}
        item = {
            "index": choice.index,
            "delta": delta,
            "logprobs": chat_logprobs_body(entries) if with_logprobs and not role else None,
            "finish_reason": finish,
        }
    if with_token_ids:
        item["token_ids"] = ids
    return {
        "id": response_id,
        "object": "text_completion" if kind == "completion" else "chat.completion.chunk",
        "created": created_s,
        "model": model,
        "choices": [item],
    }
