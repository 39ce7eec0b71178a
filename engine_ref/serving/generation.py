"""One HTTP generation request in flight: its engine requests (one per prompt), their outputs
folded into choices, and the bodies to answer with. No HTTP here: the server writes what
`collect` returns or what `stream_bodies` yields."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine_ref.serving.endpoints import Endpoint
from engine_ref.serving.engine_loop import EngineLoop, EngineLoopError, EngineRequest
from engine_ref.serving.errors import ApiError
from engine_ref.serving.interface import (
    CompletionOutput,
    DeadlineInfeasibleError,
    EngineConfigError,
    QueueFullError,
    RequestOutput,
    ServedTokenizer,
)
from engine_ref.serving.metrics import RequestTimer, ServerMetrics
from engine_ref.serving.requests import GenerationRequest
from engine_ref.serving.responses import TokenLogprob, usage_body
from engine_ref.serving.slow_readers import OutputSink
from engine_ref.serving.tools import choice_stream

LOG = logging.getLogger("engine_ref.serving.generation")


class GenerationRun:
    """The engine side of one request to `endpoint`; `response_id` names it to the client and
    prefixes its engine request ids. `retry_after_s` goes with a 429 answer when the engine
    gives no estimate of its own. A request the engine sheds under overload (finish_reason
    "shed") is answered 429 too when it is not streamed; a stream ends with that finish
    reason. At most
    `max_backlog` outputs per engine request wait for the handler; beyond that the run is
    abandoned (see `abandon`) and `on_abandon` runs (the server closes the connection).
    `with_prompt_details` adds `usage.prompt_tokens_details.cached_tokens`. The final usage
    carries `kv_memory`, the engine's memory per request (`core.kv_accounting`, summed over a
    request's prompts: `add_kv_memory`)."""

    def __init__(
        self,
        endpoint: Endpoint,
        gen: GenerationRequest,
        *,
        response_id: str,
        engine_loop: EngineLoop,
        metrics: ServerMetrics,
        retry_after_s: int,
        max_backlog: int = 1 << 30,
        with_prompt_details: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.gen = gen
        self.response_id = response_id
        self.engine_loop = engine_loop
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.with_prompt_details = with_prompt_details
        self.created_s = int(time.time())
        self.engine_ids = [f"{response_id}-{i}" for i in range(len(gen.prompts))]
        self.sink = OutputSink(max_backlog * len(self.engine_ids), self._overflowed)
        self.prompt_index = {rid: i for i, rid in enumerate(self.engine_ids)}
        self.timers: dict[str, RequestTimer] = {}
        self.unfinished: set[str] = set()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.kv_memory: dict[str, int] | None = None  # summed over the engine requests
        self.choices = [
            endpoint.new_choice(
                i, keep_history=not gen.stream, tools=choice_stream(gen.tools, response_id, i)
            )
            for i in range(gen.num_choices)
        ]
        self.on_abandon: Callable[[], None] | None = None

    async def submit(self) -> None:
        """Admit every engine request, all or none; ApiError 429/400/500 (nothing left
        running) on refusal. Cancelled meanwhile (the client went away), it leaves nothing
        running either: the engine loop aborts the group once admitted."""
        timers = {rid: self.metrics.tracker() for rid in self.engine_ids}
        requests = [
            EngineRequest(
                rid,
                prompt,
                self.gen.params,
                priority=self.gen.priority,
                cache_salt=self.gen.cache_salt,
                tenant=self.gen.tenant,
                deadline_ms=self.gen.deadline_ms,
            )
            for rid, prompt in zip(self.engine_ids, self.gen.prompts, strict=True)
        ]
        try:
            await self.engine_loop.admit(self.response_id, requests, self.sink)
        except QueueFullError as exc:
            self.metrics.request_rejected()
            if isinstance(exc, DeadlineInfeasibleError):
                raise self._overloaded(str(exc), "deadline_infeasible", exc.retry_after_s) from None
            message = "The server is at capacity (waiting queue full); retry later."
            raise self._overloaded(message, "rate_limit_exceeded", exc.retry_after_s) from None
        except (EngineConfigError, ValueError) as exc:
            raise ApiError(400, str(exc)) from None
        except EngineLoopError as exc:
            raise ApiError(500, str(exc), type="server_error") from None
        self.timers = timers
        self.unfinished.update(self.engine_ids)

    def _overloaded(self, message: str, code: str, retry_after_s: int | None) -> ApiError:
        """The 429 answer: `retry_after_s` the engine's estimate, else the server's."""
        retry_after = self.retry_after_s if retry_after_s is None else retry_after_s
        return ApiError(
            429,
            message,
            type="rate_limit_error",
            code=code,
            headers={"Retry-After": str(retry_after)},
        )

    def abort_unfinished(self, *, reason: str = "abort") -> None:
        """Abort what still runs in the engine, counting each as finished with `reason`."""
        for rid in self.unfinished:
            self.engine_loop.abort(rid)
            self.timers[rid].finished(reason)
        self.unfinished.clear()

    def abandon(self) -> None:
        """Give up on a client that stopped reading: abort the engine requests (counted as
        aborts, freeing their KV blocks) and run `on_abandon`."""
        self.abort_unfinished()
        if self.on_abandon is not None:
            self.on_abandon()

    def _overflowed(self) -> None:
        LOG.info("%s: the client fell too far behind; abandoning the request", self.response_id)
        self.abandon()

    async def next_changes(self) -> list[int]:
        """Wait for the next engine output, fold it into the choices, and return the indices
        of the choices it changed. Raises ApiError 500 when the engine failed this request
        (type internal_error, the engine's message) or failed as a whole (server_error)."""
        item = await self.sink.get()
        if isinstance(item, BaseException):
            raise ApiError(500, str(item), type="server_error")
        rid = item.request_id
        if rid not in self.unfinished:
            return []  # an output that crossed an abort
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
            self.cached_tokens += item.num_cached_tokens
            self.kv_memory = add_kv_memory(self.kv_memory, item)
            self.unfinished.discard(rid)
            if item.error is not None:
                self.timers[rid].finished("error", num_prompt_tokens=item.num_prompt_tokens)
                raise ApiError(500, item.error, type="internal_error")
            reasons = (c.finish_reason for c in self.choices[base : base + n] if c.finish_reason)
            reason = next(reasons, "stop")
            self.timers[rid].finished(reason, num_prompt_tokens=item.num_prompt_tokens)
            if reason == "shed" and not self.gen.stream:
                self.metrics.request_rejected()
                message = "The server shed this request under overload to make room; retry later."
                raise self._overloaded(message, "request_shed", None)
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

    def usage(self) -> dict[str, Any]:
        """The usage so far: the engine's prompt counts once every request finished, before
        that (continuous usage) the prompts' lengths, which is what they will say."""
        completion_tokens = sum(c.num_output_tokens for c in self.choices)
        cached = self.cached_tokens if self.with_prompt_details else None
        prompt_tokens = (
            sum(len(p) for p in self.gen.prompts) if self.unfinished else self.prompt_tokens
        )
        kv = None if self.unfinished else self.kv_memory
        usage = usage_body(prompt_tokens, completion_tokens, cached_tokens=cached, kv_memory=kv)
        return self.endpoint.usage_details(usage, self.choices)

    async def collect(self) -> dict[str, Any]:
        """The complete body once every engine request finished; ApiError 500 when the engine
        failed one of them or failed as a whole meanwhile, 429 when it shed one (the others
        are then aborted)."""
        while self.unfinished:
            try:
                await self.next_changes()
            except ApiError:
                self.abort_unfinished()
                raise
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
        then the usage chunk if asked for. An engine failure (of one of this request's engine
        requests, or of the engine) yields one error body instead and ends the stream; the
        others are aborted."""
        header = (self.response_id, self.created_s, self.gen.model)
        for body in self.endpoint.opening_chunks(
            *header, self.choices, with_token_ids=self.gen.return_token_ids
        ):
            yield self._with_usage_field(body)
        while self.unfinished:
            try:
                changed = await self.next_changes()
            except ApiError as exc:
                self.abort_unfinished()
                yield exc.body()
                return
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
        # With include_usage, OpenAI sends `"usage": null` on every chunk but the last; with
        # vLLM's continuous_usage_stats every chunk carries the usage so far.
        if self.gen.include_usage:
            chunk["usage"] = self.usage() if self.gen.continuous_usage else None
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


def add_kv_memory(total: dict[str, int] | None, item: RequestOutput) -> dict[str, int] | None:
    """`total` with one finished engine request's memory record added: bytes, blocks and steps
    summed (the prompts of one HTTP request run side by side), the block geometry kept, and its
    evicted-context tokens (`RequestOutput.kv_evicted_tokens`, lossy eviction) in
    `kv_evicted_tokens`."""
    record = item.kv_memory
    if record is None:
        return total
    record = {**record, "kv_evicted_tokens": item.kv_evicted_tokens}
    if total is None:
        return record
    kept = ("block_size", "block_bytes")
    return {k: v if k in kept else total.get(k, 0) + v for k, v in record.items()}
