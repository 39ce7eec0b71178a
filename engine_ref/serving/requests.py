"""Request side of the OpenAI wire protocol: a JSON body becomes a validated
`GenerationRequest` (prompt token ids plus `SamplingParams`), or an `ApiError` whose OpenAI
error body names the offending field.

Pure functions; nothing here touches the network or the engine loop. Supported fields (others
are ignored, as OpenAI-compatible servers do): `model`, `prompt` (completions: a string, a list
of token ids, or a list of either) or `messages` (chat), `max_tokens` (chat also
`max_completion_tokens`), `n`, `temperature`, `top_p`, `top_k`, `seed`, `stop`,
`stop_token_ids`, `ignore_eos`, `min_tokens`, `logprobs`, `top_logprobs` (chat), `priority`,
`user` (the tenant a `fair` scheduling policy charges, at most 256 characters),
`stream`, `stream_options.include_usage` (and vLLM's `stream_options.continuous_usage_stats`:
every chunk then carries the cumulative usage so far, so a client can count the tokens each
chunk adds), `return_token_ids` (vLLM extension: each choice
and chunk carries the token ids it adds) and `cache_salt` (vLLM extension: requests share
prefix-cache blocks only with requests of the same salt) and `speculative` (engine_ref
extension: false opts the request out of the server's `--speculative-config`; outputs are the
same either way), and the output constraints of `engine_ref.serving.guided` (`response_format`,
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `structured_outputs`), and
(chat) `tools`, `tool_choice` and `parallel_tool_calls` (`engine_ref.serving.tools`).

One header: `x-request-deadline-ms` (engine_ref extension), the milliseconds the request has
from the moment the engine receives it (`deadline_header`): past it, the request ends with
finish_reason "deadline" keeping what it generated (a non-streamed answer is then a 200 with
that text), and under the `edf` scheduling policy a deadline the engine cannot meet is
refused at once (429 with the reason and Retry-After).

Beam search takes vLLM's older request shape: `use_beam_search`, `best_of` (the beam width, at
least `n`; above 1 only with beam search), `length_penalty`; the `n` best beams come back when
the search ends (streamed, they arrive as one chunk each at the end).

Size limits come before the work they bound: a request's prompt text (all its prompts, or all
its messages' contents) is counted against `max_prompt_chars` before it is rendered or
tokenized, a token-id prompt is measured before its ids are checked, and every prompt must
leave room for one output token within `max_model_len`. Parsing may take a while for a long
prompt: the server runs it in a worker thread (see `_encode_texts` for why that helps).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine_ref.serving.errors import ApiError
from engine_ref.serving.fields import (
    check_encodable,
    optional_bool,
    optional_int,
    optional_number,
    optional_string,
    shown,
    stop_strings,
    stop_token_ids,
)
from engine_ref.serving.guided import guided_decoding
from engine_ref.serving.interface import (
    MAX_DEADLINE_MS,
    MAX_TENANT_CHARS,
    EngineConfigError,
    SamplingParams,
    ServedTokenizer,
)
from engine_ref.serving.tools import ToolRequest, parse_tools

_MAX_N = 64
_MAX_LOGPROBS = 20
MAX_PROMPTS = 1024  # prompts in one completions request
MAX_CACHE_SALT_CHARS = 1024
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
DEADLINE_HEADER = "x-request-deadline-ms"


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
    cache_salt: str | None = None
    continuous_usage: bool = False  # every chunk carries the usage so far (with include_usage)
    tenant: str | None = None  # OpenAI's `user`: whose share a fair scheduling policy charges
    deadline_ms: int | None = None  # the `x-request-deadline-ms` header
    tools: ToolRequest | None = None  # chat tools whose tool_choice forces calls

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None


def deadline_header(value: str | None) -> int | None:
    """The `x-request-deadline-ms` header's value as milliseconds (None when absent); ApiError
    400 unless it is a whole number from 1 to `MAX_DEADLINE_MS`."""
    if value is None:
        return None
    text = value.strip()
    short = len(text) <= len(str(MAX_DEADLINE_MS))  # before int() reads it
    if short and text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_DEADLINE_MS:
        return int(text)
    raise ApiError(
        400,
        f"The {DEADLINE_HEADER} header must be a whole number of milliseconds from 1 to "
        f"{MAX_DEADLINE_MS}, got {shown(value)}.",
        param=DEADLINE_HEADER,
    )


def decode_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; ApiError 400 for invalid UTF-8, malformed JSON, JSON
    nested deeper than Python's recursion limit (about 1,000 levels), an integer of more than
    4,300 digits, or a non-object. (Lone surrogates are caught where strings are used.)"""
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
    except RecursionError:
        raise ApiError(400, "Request body is nested too deeply.") from None
    except ValueError as exc:  # e.g. an integer beyond Python's digit limit
        raise ApiError(400, f"Request body holds an unreadable value: {exc}.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object.")
    return body


def parse_completion_request(
    body: dict[str, Any],
    *,
    tokenizer: ServedTokenizer,
    served_model: str,
    max_model_len: int,
    max_prompt_chars: int | None = None,
) -> GenerationRequest:
    """Validate a /v1/completions body; raises ApiError with status 400 or 404.
    `max_prompt_chars` None means no bound on the prompt text."""
    _check_model(body, served_model)
    prompts = _completion_prompts(
        body.get("prompt"),
        tokenizer,
        max_model_len=max_model_len,
        max_prompt_chars=max_prompt_chars,
    )
    logprobs = optional_int(body, "logprobs", low=0, high=_MAX_LOGPROBS)
    if optional_bool(body, "echo"):
        raise ApiError(400, "echo is not supported by this server.", param="echo")
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
    body: dict[str, Any],
    *,
    tokenizer: ServedTokenizer,
    served_model: str,
    max_model_len: int,
    max_prompt_chars: int | None = None,
) -> GenerationRequest:
    """Validate a /v1/chat/completions body and render its messages with the model's chat
    template; raises ApiError with status 400 or 404. `max_prompt_chars` bounds the
    messages' contents together (None: no bound)."""
    _check_model(body, served_model)
    messages = _chat_messages(body.get("messages"))
    _check_prompt_chars(sum(len(m["content"]) for m in messages), max_prompt_chars, "messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as exc:  # the tokenizer's ChatTemplateError is a ValueError
        raise ApiError(400, str(exc), param="messages") from None
    (ids,) = _encode_texts(tokenizer, [text])
    prompt = tuple(ids)
    _check_prompt_tokens(len(prompt), max_model_len, "messages")
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
        tools=parse_tools(body),
    )


def _build(
    body: dict[str, Any],
    *,
    served_model: str,
    prompts: tuple[tuple[int, ...], ...],
    max_tokens: int | None,
    logprobs: int | None,
    max_model_len: int,
    tools: ToolRequest | None = None,
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
        "stop_token_ids": stop_token_ids(body),
        "ignore_eos": optional_bool(body, "ignore_eos"),
        "logprobs": logprobs,
        "min_tokens": min_tokens,
        "speculative": optional_bool(body, "speculative"),
        "guided": _guided(body, tools),
        "use_beam_search": optional_bool(body, "use_beam_search"),
        "best_of": optional_int(body, "best_of", low=1),
        "length_penalty": optional_number(body, "length_penalty"),
    }
    try:
        params = SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except EngineConfigError as exc:
        raise ApiError(400, str(exc)) from None
    stream = bool(optional_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = continuous_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object.", param="stream_options")
        include_usage = bool(optional_bool(options, "include_usage"))
        continuous = optional_bool(options, "continuous_usage_stats")
        continuous_usage = include_usage and bool(continuous)
    return GenerationRequest(
        model=served_model,
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=include_usage,
        priority=optional_int(body, "priority") or 0,
        return_token_ids=bool(optional_bool(body, "return_token_ids")),
        cache_salt=optional_string(body, "cache_salt", max_chars=MAX_CACHE_SALT_CHARS),
        continuous_usage=continuous_usage,
        tenant=optional_string(body, "user", max_chars=MAX_TENANT_CHARS),
        tools=tools,
    )


def _guided(body: dict[str, Any], tools: ToolRequest | None):
    """The output constraint: the request's own, or the grammar of tools that force calls."""
    guided = guided_decoding(body)
    if tools is None:
        return guided
    if guided is not None:
        raise ApiError(
            400,
            "A tool_choice that forces calls constrains the output, so the request may set "
            "no other output constraint.",
            param="tool_choice",
        )
    return tools.guided


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


def _completion_prompts(
    prompt: Any,
    tokenizer: ServedTokenizer,
    *,
    max_model_len: int,
    max_prompt_chars: int | None,
) -> tuple[tuple[int, ...], ...]:
    if prompt is None:
        raise ApiError(400, "prompt is required.", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_int(prompt[0])):
        items = [prompt]  # one prompt: a string or a list of token ids
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise ApiError(400, _PROMPT_SHAPE, param="prompt")
    if len(items) > MAX_PROMPTS:
        raise ApiError(
            400,
            f"prompt has {len(items)} prompts; at most {MAX_PROMPTS} are allowed.",
            param="prompt",
        )
    texts = [item for item in items if isinstance(item, str)]
    _check_prompt_chars(sum(len(t) for t in texts), max_prompt_chars, "prompt")
    vocab_size = tokenizer.vocab_size
    for item in items:
        if isinstance(item, str):
            check_encodable(item, "prompt")
            continue
        if not isinstance(item, list) or not item:
            raise ApiError(400, _PROMPT_SHAPE, param="prompt")
        _check_prompt_tokens(len(item), max_model_len, "prompt")  # before reading every id
        if not all(_is_int(t) for t in item):
            raise ApiError(400, _PROMPT_SHAPE, param="prompt")
        if any(not 0 <= t < vocab_size for t in item):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size}).", param="prompt")
    encoded = iter(_encode_texts(tokenizer, texts))
    prompts = []
    for item in items:
        ids = tuple(next(encoded) if isinstance(item, str) else item)
        if not ids:
            raise ApiError(400, "prompt must not be empty.", param="prompt")
        _check_prompt_tokens(len(ids), max_model_len, "prompt")
        prompts.append(ids)
    return tuple(prompts)


_PROMPT_SHAPE = "prompt must be a string, a list of token ids, or a non-empty list of either."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _encode_texts(tokenizer: ServedTokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text. Hugging Face tokenizers release the GIL in `encode_batch` but
    hold it through `encode`, so a long prompt tokenized in a worker thread stalls the event
    loop (and every stream on it) unless it goes through `encode_batch`; a tokenizer without
    one (a test double) encodes each text with `encode`."""
    if not texts:
        return []
    encode_batch = getattr(tokenizer, "encode_batch", None)
    if encode_batch is None:
        return [tokenizer.encode(t) for t in texts]
    return encode_batch(texts)


def _check_prompt_chars(num_chars: int, max_prompt_chars: int | None, param: str) -> None:
    if max_prompt_chars is not None and num_chars > max_prompt_chars:
        raise ApiError(
            400,
            f"The prompt text has {num_chars} characters; this server accepts at most "
            f"{max_prompt_chars} per request (--max-prompt-chars).",
            param=param,
            code="context_length_exceeded",
        )


def _check_prompt_tokens(num_tokens: int, max_model_len: int, param: str) -> None:
    if num_tokens >= max_model_len:
        raise ApiError(
            400,
            f"The prompt has {num_tokens} tokens, but this model's maximum context length is "
            f"{max_model_len} tokens, and the completion needs at least one; shorten the "
            "prompt.",
            param=param,
            code="context_length_exceeded",
        )


def _chat_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list.", param="messages")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object.", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in _CHAT_ROLES:
            raise ApiError(
                400,
                f"messages[{i}].role must be one of {', '.join(sorted(_CHAT_ROLES))}, "
                f"got {shown(role)}.",
                param="messages",
            )
        rendered.append({"role": role, "content": _message_text(message.get("content"), i)})
    return rendered


def _message_text(content: Any, i: int) -> str:
    """A message's content as one string: a string, or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        check_encodable(content, "messages")
        return content
    if not isinstance(content, list):
        raise ApiError(
            400,
            f"messages[{i}].content must be a string or a list of text parts, "
            f"got {shown(content)}.",
            param="messages",
        )
    parts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise ApiError(
                400, f"messages[{i}].content parts must be text parts.", param="messages"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ApiError(400, f"messages[{i}] text part needs a string.", param="messages")
        check_encodable(text, "messages")
        parts.append(text)
    return "".join(parts)
