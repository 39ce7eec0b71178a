"""One HTTP generation request in flight: its engine requests (one per prompt), their outputs
folded into choices, and the bodies to answer with. No HTTP here: the server writes what
`collect` returns or what `stream_bodies` yields."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from engine_ref.serving.endpoints import Endpoint
from engine_ref.serving.engine_loop import EngineLoop, EngineLoopError
from engine_ref.serving.errors import ApiError, error_body
from engine_ref.serving.interface import (
    CompletionOutput,
    EngineConfigError,
    QueueFullError,
    RequestOutput,
    ServedTokenizer,
)
from engine_ref.serving.metrics import RequestTimer, ServerMetrics
from engine_ref.serving.requests import GenerationRequest
from engine_ref.serving.responses import ChoiceAccumulator, TokenLogprob, usage_body


class GenerationRun:
    """The engine side of one request to `endpoint`; `response_id` names it to the client and
    prefixes its engine request ids. `retry_after_s` goes with a 429 answer."""

    def __init__(
        self,
        endpoint: Endpoint,
        gen: GenerationRequest,
        *,
        response_id: str,
        engine_loop: EngineLoop,
        metrics: ServerMetrics,
        retry_after_s: int,
    ) -> None:
        self.endpoint = endpoint
        self.gen = gen
        self.response_id = response_id
        self.engine_loop = engine_loop
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.created_s = int(time.time())
        self.sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.engine_ids = [f"{response_id}-{i}" for i in range(len(gen.prompts))]
        self.prompt_index = {rid: i for i, rid in enumerate(self.engine_ids)}
        self.timers: dict[str, RequestTimer] = {}
        self.unfinished: set[str] = set()
        self.prompt_tokens = 0
        self.choices = [ChoiceAccumulator(i) for i in range(gen.num_choices)]

    async def submit(self) -> None:
        """Add every engine request; ApiError 429/400/500 (nothing left running) on refusal."""
        for rid, prompt in zip(self.engine_ids, self.gen.prompts, strict=True):
            timer = self.metrics.tracker()
            try:
                await self.engine_loop.add_request(
                    rid, prompt, self.gen.params, self.sink, priority=self.gen.priority
                )
            except QueueFullError:
                self.abort_unfinished(count=False)
                self.metrics.request_rejected()
                raise ApiError(
                    429,
                    "The server is at capacity (waiting queue full); retry later.",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(self.retry_after_s)},
                ) from None
            except (EngineConfigError, ValueError) as exc:
                self.abort_unfinished(count=False)
                raise ApiError(400, str(exc)) from None
            except EngineLoopError as exc:
                self.abort_unfinished(count=False)
                raise ApiError(500, str(exc), type="server_error") from None
            self.timers[rid] = timer
            self.unfinished.add(rid)

    def abort_unfinished(self, *, count: bool = True) -> None:
        for rid in self.unfinished:
            self.engine_loop.abort(rid)
            if count:
                self.timers[rid].finished("abort")
        self.unfinished.clear()

    async def next_changes(self) -> list[int]:
        """Wait for the next engine output, fold it into the choices, and return the indices
        of the choices it changed. Raises EngineLoopError when the engine failed."""
        item = await self.sink.get()
        if isinstance(item, BaseException):
            raise item
        rid = item.request_id
        n = self.gen.params.n
        base = self.prompt_index[rid] * n
        changed = []
        num_new_tokens = 0
        for completion in item.outputs:
            choice = self.choices[base + completion.index]
            choice.add(
                completion.new_text,
                list(completion.new_token_ids),
                self._logprobs(completion),
                completion.finish_reason,
                completion.num_output_tokens,
            )
            num_new_tokens += len(completion.new_token_ids)
            changed.append(choice.index)
        self.timers[rid].tokens_out(num_new_tokens)
        if item.finished:
            self.prompt_tokens += item.num_prompt_tokens
            self.unfinished.discard(rid)
            reasons = (c.finish_reason for c in self.choices[base : base + n] if c.finish_reason)
            reason = next(reasons, "stop")
            self.timers[rid].finished(reason, num_prompt_tokens=item.num_prompt_tokens)
        return changed

    def _logprobs(self, completion: CompletionOutput) -> list[TokenLogprob]:
        if completion.logprobs is None or self.gen.params.logprobs is None:
            return []
        return decoded_logprobs(
            completion.new_token_ids,
            completion.logprobs,
            self.engine_loop.info.tokenizer,
            top_k=self.gen.params.logprobs,
        )

    def usage(self) -> dict[str, int]:
        completion_tokens = sum(c.num_output_tokens for c in self.choices)
        return usage_body(self.prompt_tokens, completion_tokens)

    async def collect(self) -> dict[str, Any]:
        """The complete body once every engine request finished; ApiError 500 when the engine
        failed meanwhile."""
        while self.unfinished:
            try:
                await self.next_changes()
            except EngineLoopError as exc:
                self.abort_unfinished()
                raise ApiError(500, str(exc), type="server_error") from None
        return self.endpoint.response_body(
            self.response_id,
            self.created_s,
            self.gen.model,
            self.choices,
            self.usage(),
            with_logprobs=self.gen.wants_logprobs,
            with_token_ids=self.gen.return_token_ids,
        )

    async def stream_bodies(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks as they become due (one per engine output per changed choice),
        then the usage chunk if asked for. An engine failure yields one error body and ends
        the stream, usage chunk included."""
        header = (self.response_id, self.created_s, self.gen.model)
        for body in self.endpoint.opening_chunks(
            *header, self.choices, with_token_ids=self.gen.return_token_ids
        ):
            yield self._with_usage_field(body)
        while self.unfinished:
            try:
                changed = await self.next_changes()
            except EngineLoopError as exc:
                self.abort_unfinished()
                yield error_body(str(exc), type="server_error")
                break
            for index in changed:
                choice = self.choices[index]
                if choice.has_pending():
                    chunk = self.endpoint.chunk_body(
                        *header,
                        choice,
                        with_logprobs=self.gen.wants_logprobs,
                        with_token_ids=self.gen.return_token_ids,
                    )
                    yield self._with_usage_field(chunk)
        if self.gen.include_usage:
            yield self.endpoint.usage_chunk(*header, self.usage())

    def _with_usage_field(self, chunk: dict[str, Any]) -> dict[str, Any]:
        # With include_usage, OpenAI sends `"usage": null` on every chunk but the last.
        if self.gen.include_usage:
            chunk["usage"] = None
        return chunk


def decoded_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, float]],
    tokenizer: ServedTokenizer,
    *,
    top_k: int,
) -> list[TokenLogprob]:
    """The engine's per-token `{token_id: logprob}` maps (sampled token plus alternatives) as
    decoded entries; each top list keeps the `top_k` most likely."""
    entries = []
    for token_id, by_id in zip(token_ids, logprobs, strict=True):
        ranked = sorted(by_id.items(), key=lambda item: -item[1])[:top_k]
        entries.append(
            TokenLogprob(
                token=tokenizer.decode([token_id], skip_special_tokens=False),
                logprob=float(by_id[token_id]),
                top=tuple(
                    (tokenizer.decode([t], skip_special_tokens=False), float(lp))
                    for t, lp in ranked
                ),
            )
        )
    return entries
