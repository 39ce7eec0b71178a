"""A scripted fake engine with the `LLMEngine` API (`EngineInterface`), for fast, deterministic
server tests: it emits SCRIPT_TEXT's tokens and fails or stalls on demand."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from engine_ref.core.detokenizer import IncrementalDetokenizer
from engine_ref.core.engine import CompletionOutput, RequestOutput
from engine_ref.core.engine_config import SamplingParams
from engine_ref.core.scheduler import QueueFullError
from engine_ref.loading.tiny_random import build_tiny_tokenizer

SCRIPT_TEXT = "Hello 東京 😀 world! "


@dataclass
class _FakeRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    detoks: list[IncrementalDetokenizer]
    produced: list[int] = field(default_factory=list)


class FakeEngine:
    """Emits the tokens of SCRIPT_TEXT in a cycle, one per step per sample, until max_tokens.
    At most `max_running` requests run; `max_waiting` more may wait. `fail_next_step` makes
    the next step raise, `fail_next_add` the next add and `fail_nth_add` the n-th add since
    construction (as a bug would). Each running sample holds one KV "block". `add_s` is how
    long each add takes. `completed` lists the requests that ran to their end. A request
    whose prompt holds `poison_token` fails alone at its second step, as the engine fails a
    request it cannot run (finish_reason "error", `RequestOutput.error` saying why)."""

    def __init__(
        self,
        *,
        max_running: int = 64,
        max_waiting: int = 64,
        step_s: float = 0.0,
        add_s: float = 0.0,
        poison_token: int | None = None,
        fail_nth_add: int | None = None,
        max_model_len: int = 128,
    ):
        self.tokenizer = build_tiny_tokenizer()
        self.config = SimpleNamespace(model="fake-model")
        self.max_model_len = max_model_len  # reported through stats(), as LLMEngine does
        self.script = self.tokenizer.encode(SCRIPT_TEXT)
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.step_s = step_s
        self.add_s = add_s
        self.poison_token = poison_token
        self.fail_nth_add = fail_nth_add
        self.num_add_calls = 0
        self.last_deadline_ms: int | None = None  # as the latest add_request passed it
        self.num_added = 0
        self.completed: list[str] = []
        self.fail_next_step = False
        self.fail_next_add = False
        self.stalled = False
        self.step_calls = 0
        self.num_steps = 0
        self.running: dict[str, _FakeRequest] = {}
        self.waiting: dict[str, _FakeRequest] = {}
        self.aborted: list[str] = []
        self.total_blocks = 256

    def add_request(
        self,
        request_id,
        prompt_token_ids,
        params,
        *,
        priority=0,
        cache_salt=None,
        tenant=None,
        deadline_ms=None,
    ):
        time.sleep(self.add_s)
        self.num_add_calls += 1
        self.last_deadline_ms = deadline_ms
        if self.num_add_calls == self.fail_nth_add:
            raise KeyError("unexpected bug")
        if self.fail_next_add:
            self.fail_next_add = False
            raise KeyError("unexpected bug")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError("waiting queue full")
        detoks = [
            IncrementalDetokenizer(self.tokenizer.decode, prompt_token_ids) for _ in range(params.n)
        ]
        self.waiting[request_id] = _FakeRequest(request_id, prompt_token_ids, params, detoks)
        self.num_added += 1

    def abort(self, request_id):
        if self.running.pop(request_id, None) or self.waiting.pop(request_id, None):
            self.aborted.append(request_id)

    def has_unfinished(self):
        return bool(self.running or self.waiting)

    def step(self):
        self.step_calls += 1
        if self.stalled:  # nothing can be scheduled: no progress, no outputs
            return []
        self.num_steps += 1
        time.sleep(self.step_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected failure")
        while self.waiting and len(self.running) < self.max_running:
            request_id = next(iter(self.waiting))
            self.running[request_id] = self.waiting.pop(request_id)
        outputs = []
        for request in list(self.running.values()):
            if request.produced and self.poison_token in request.prompt:
                outputs.append(self._fail(request))
                continue
            token = self.script[len(request.produced) % len(self.script)]
            request.produced.append(token)
            done = len(request.produced) >= request.params.max_tokens
            completions = []
            for index, detok in enumerate(request.detoks):
                text = detok.add([token]) + (detok.flush() if done else "")
                logprobs = None
                if request.params.logprobs is not None:
                    logprobs = [{token: -0.5, (token + 1) % 512: -1.5, (token + 2) % 512: -2.5}]
                completions.append(
                    CompletionOutput(
                        index,
                        [token],
                        text,
                        "length" if done else None,
                        len(request.produced),
                        logprobs,
                    )
                )
            outputs.append(
                RequestOutput(request.request_id, completions, done, len(request.prompt), 0)
            )
            if done:
                del self.running[request.request_id]
                self.completed.append(request.request_id)
        return outputs

    def _fail(self, request: _FakeRequest) -> RequestOutput:
        del self.running[request.request_id]
        completions = [
            CompletionOutput(index, [], "", "error", len(request.produced))
            for index in range(request.params.n)
        ]
        error = "The engine failed this request: RuntimeError: poisoned prompt"
        return RequestOutput(
            request.request_id, completions, True, len(request.prompt), 0, error=error
        )

    def stats(self):
        used = sum(r.params.n for r in self.running.values())
        return SimpleNamespace(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=used / self.total_blocks,
            num_blocks_used=used,
            num_blocks_free=self.total_blocks - used,
            num_blocks_cached=0,
            prefix_cache_query_tokens=0,
            prefix_cache_hit_tokens=0,
            num_preemptions=0,
            prompt_tokens_total=0,
            generation_tokens_total=0,
            max_model_len=self.max_model_len,
            num_steps=self.num_steps,
        )
