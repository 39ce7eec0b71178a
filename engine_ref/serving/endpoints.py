"""The OpenAI generation endpoints as small adapters, registered by name in `ENDPOINTS`
(`events_api` adds the Responses and Messages APIs on the same base).

An adapter says how its requests parse and how one choice renders (a completion's `text`, a
chat `message` or `delta`); `Endpoint` builds the full bodies, stream chunks and usage chunk
from that, so the server handles both endpoints with one code path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from engine_ref.serving.errors import ApiError
from engine_ref.serving.interface import ServedTokenizer
from engine_ref.serving.requests import (
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
)
from engine_ref.serving.responses import (
    SSE_DONE,
    ChoiceAccumulator,
    ChoiceDelta,
    chat_logprobs_body,
    completion_logprobs_body,
    envelope,
    sse_event,
)
from engine_ref.serving.tools import finish_reason, tool_delta, tool_message


class Endpoint(ABC):
    """One OpenAI generation endpoint: its path, ids and object names, request parsing, and
    the per-choice shapes of its answers."""

    name: ClassVar[str]
    path: ClassVar[str]
    id_prefix: ClassVar[str]
    object_name: ClassVar[str]  # of a complete (non-streamed) body
    chunk_object_name: ClassVar[str]

    # The request parser of this endpoint (`requests.parse_*_request`).
    parser: ClassVar[Callable[..., GenerationRequest]]

    def parse(
        self,
        body: dict[str, Any],
        *,
        tokenizer: ServedTokenizer,
        served_model: str,
        max_model_len: int,
        max_prompt_chars: int | None = None,
    ) -> GenerationRequest:
        """Validate a request body; raises ApiError (400 or 404). `max_prompt_chars` bounds
        its prompt text before it is tokenized (None: no bound)."""
        return type(self).parser(
            body,
            tokenizer=tokenizer,
            served_model=served_model,
            max_model_len=max_model_len,
            max_prompt_chars=max_prompt_chars,
        )

    @abstractmethod
    def choice(self, choice: ChoiceAccumulator, *, with_logprobs: bool) -> dict[str, Any]:
        """A finished choice of a complete body, without `token_ids`."""

    @abstractmethod
    def delta(self, delta: ChoiceDelta, *, with_logprobs: bool) -> dict[str, Any]:
        """A choice of a stream chunk carrying `delta`, without `token_ids`."""

    def opening(self, index: int) -> dict[str, Any] | None:
        """The choice of the chunk sent for choice `index` before any token, if any."""
        return None

    def new_choice(self, index: int, **options: Any) -> ChoiceAccumulator:
        """The accumulator of choice `index` (`reasoning` splits its text; others don't)."""
        return ChoiceAccumulator(index, **options)

    def usage_details(self, usage: dict[str, Any], choices: list) -> dict[str, Any]:
        """`usage` with what this endpoint adds from its `choices` (nothing here)."""
        return usage

    def response_body(
        self,
        response_id: str,
        created_s: int,
        model: str,
        choices: list[ChoiceAccumulator],
        usage: dict[str, Any],
        *,
        with_logprobs: bool,
        with_token_ids: bool,
    ) -> dict[str, Any]:
        """A complete (non-streaming) body."""
        rendered = []
        for choice in choices:
            item = self.choice(choice, with_logprobs=with_logprobs)
            if with_token_ids:
                item["token_ids"] = list(choice.token_ids)
            rendered.append(item)
        return envelope(response_id, self.object_name, created_s, model, rendered, usage=usage)

    def chunk_body(
        self,
        response_id: str,
        created_s: int,
        model: str,
        choice: ChoiceAccumulator,
        *,
        with_logprobs: bool,
        with_token_ids: bool,
    ) -> dict[str, Any]:
        """One stream chunk carrying what `choice` produced since its last chunk."""
        delta = choice.take_pending()
        item = self.delta(delta, with_logprobs=with_logprobs)
        if with_token_ids:
            item["token_ids"] = delta.token_ids
        return envelope(response_id, self.chunk_object_name, created_s, model, [item])

    def opening_chunks(
        self,
        response_id: str,
        created_s: int,
        model: str,
        choices: list[ChoiceAccumulator],
        *,
        with_token_ids: bool,
    ) -> list[dict[str, Any]]:
        """The chunks a stream opens with, before any token (none, or one per choice)."""
        chunks = []
        for choice in choices:
            item = self.opening(choice.index)
            if item is None:
                continue
            if with_token_ids:
                item["token_ids"] = []
            chunks.append(envelope(response_id, self.chunk_object_name, created_s, model, [item]))
        return chunks

    def usage_chunk(
        self, response_id: str, created_s: int, model: str, usage: dict[str, Any]
    ) -> dict[str, Any]:
        """The last chunk of a stream that asked for `stream_options.include_usage`."""
        return envelope(response_id, self.chunk_object_name, created_s, model, [], usage=usage)

    def error_body(self, error: ApiError) -> dict[str, Any]:
        """The body of an error answer, in this API's error shape (OpenAI's here)."""
        return error.body()

    async def sse_frames(self, bodies: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        """A stream's bytes for its `bodies`: each one `data:` event, then `data: [DONE]`
        (the typed-event APIs of `events_api` frame theirs otherwise)."""
        async for body in bodies:
            yield sse_event(body)
        yield SSE_DONE


class CompletionsEndpoint(Endpoint):
    """POST /v1/completions: `text_completion` bodies and chunks, each choice a `text`."""

    name = "completion"
    path = "/v1/completions"
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    parser = staticmethod(parse_completion_request)

    def choice(self, choice: ChoiceAccumulator, *, with_logprobs: bool) -> dict[str, Any]:
        return {
            "index": choice.index,
            "text": choice.text,
            "logprobs": completion_logprobs_body(choice.logprobs, 0) if with_logprobs else None,
            "finish_reason": choice.finish_reason,
        }

    def delta(self, delta: ChoiceDelta, *, with_logprobs: bool) -> dict[str, Any]:
        logprobs = None
        if with_logprobs:
            logprobs = completion_logprobs_body(delta.logprobs, delta.text_offset_chars)
        return {
            "index": delta.index,
            "text": delta.text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
        }


class ChatEndpoint(Endpoint):
    """POST /v1/chat/completions: an assistant `message` per choice; a stream opens each
    choice with a role chunk, then carries `delta`s."""

    name = "chat"
    path = "/v1/chat/completions"
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    parser = staticmethod(parse_chat_request)

    def choice(self, choice: ChoiceAccumulator, *, with_logprobs: bool) -> dict[str, Any]:
        message = {"role": "assistant", "content": choice.text}
        finish = choice.finish_reason
        if choice.tools is not None:  # the text is function calls (`tools`)
            message = tool_message(choice.tools, choice.text)
            finish = finish_reason(finish, bool(message["tool_calls"]))
        return {
            "index": choice.index,
            "message": message,
            "logprobs": chat_logprobs_body(choice.logprobs) if with_logprobs else None,
            "finish_reason": finish,
        }

    def delta(self, delta: ChoiceDelta, *, with_logprobs: bool) -> dict[str, Any]:
        # The last chunk carries only the finish reason, with an empty delta.
        content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
        finish = delta.finish_reason
        if delta.tools is not None:  # the text is function calls (`tools`)
            content = tool_delta(delta.tools, delta.text)
            finish = finish_reason(finish, bool(delta.tools.calls()))
        return {
            "index": delta.index,
            "delta": content,
            "logprobs": chat_logprobs_body(delta.logprobs) if with_logprobs else None,
            "finish_reason": finish,
        }

    def opening(self, index: int) -> dict[str, Any] | None:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }


ENDPOINTS: Mapping[str, Endpoint] = MappingProxyType(
    {e.name: e for e in (CompletionsEndpoint(), ChatEndpoint())}
)


def endpoint(name: str) -> Endpoint:
    """The registered endpoint called `name`; KeyError listing the known names otherwise."""
    try:
        return ENDPOINTS[name]
    except KeyError:
        known = ", ".join(sorted(ENDPOINTS))
        raise KeyError(f"Unknown endpoint {name!r}; known endpoints: {known}.") from None
