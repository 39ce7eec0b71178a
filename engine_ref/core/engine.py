"""`LLMEngine`: add requests, run scheduler iterations, abort, report stats.

One `step()` = schedule -> copy-on-write block copies -> execute: one forward over the
flattened batch (decode rows and prefill chunks together) and logits for the rows that sample
(`ModelRunner.forward`), masked by each guided request's grammar (speculative rows by the
grammar's state after the drafted tokens before them), sample (`OutputProcessor.sample`) ->
commit (`OutputProcessor.commit`): advance computed counts, enter full blocks into the prefix
cache, fork, append tokens (advancing grammars by committed tokens only), detokenise, check
stop conditions -> free finished sequences' blocks once the step is over.

Execution commits nothing, so a step whose execution raises is retried on part of its batch,
bisected by request until the requests that fail on their own are found; only those fail
(finish_reason "error", `RequestOutput.error` saying why) and the rest commit. Retries rewrite
the same KV slots (positions past each sequence's computed tokens, in blocks it alone holds)
and restore seeded generators, so the others' tokens are those of a step without the failed
requests. A step that does not fail pays nothing for this.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from engine_ref.core.admission import EngineError, check_prompt, check_request
from engine_ref.core.block_manager import BlockManager, HashFn, default_hash
from engine_ref.core.engine_config import EngineConfig, SamplingParams
from engine_ref.core.isolation import isolate_failures
from engine_ref.core.kv_accounting import KVAccounting
from engine_ref.core.model import LlamaModel
from engine_ref.core.model_runner import ModelRunner
from engine_ref.core.output_processor import Executed, OutputProcessor
from engine_ref.core.outputs import CompletionOutput, RequestOutput
from engine_ref.core.overload import OverloadControl
from engine_ref.core.scheduler import Scheduler
from engine_ref.core.sequence import Request, Sequence
from engine_ref.core.spec_decode import SpeculativeDecoder
from engine_ref.core.stats import EngineStats
from engine_ref.core.step_meter import StepMeter, StepRates

__all__ = ["CompletionOutput", "EngineError", "LLMEngine", "RequestOutput"]


class LLMEngine:
    """The reference engine over `loaded` (an `engine_ref.loading.LoadedModel`, or anything
    with `config`, `state_dict` and `tokenizer`) and, for a `draft_model` speculative config,
    `draft_loaded`; `engine_ref.build_engine(config)` loads both from the config. `hash_fn`
    replaces the prefix-cache hash (tests force collisions with it); deadlines are measured on
    `clock` (s) and estimated from `rates` (`core.step_meter`). Raises EngineError when `loaded`
    is missing or the config cannot be served."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: Any = None,
        hash_fn: HashFn = default_hash,
        draft_loaded: Any = None,
        clock: Callable[[], float] = time.monotonic,
        rates: StepRates | None = None,
    ) -> None:
        if loaded is None:
            raise EngineError(
                "LLMEngine takes an already loaded model (loaded=...); to load "
                f"{config.model!r} and build the engine, call engine_ref.build_engine(config)."
            )
        self.config = config
        self.model_runner = runner = ModelRunner(config, loaded, draft_loaded)
        self.device, self.dtype = runner.device, runner.dtype
        self.model_config, self.max_model_len = runner.model_config, runner.max_model_len
        tokenizer = loaded.tokenizer
        self.block_manager = BlockManager(
            runner.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            salt=f"{config.prefix_cache_salt}|{tokenizer.name}|{config.model}|{runner.kv_cache_key}",
            hash_fn=hash_fn,
        )
        self.scheduler = scheduler = Scheduler(config, self.block_manager)
        spec = config.speculative_config
        self.spec = spec and SpeculativeDecoder(spec, max_model_len=runner.max_model_len)
        self.output_processor = processor = OutputProcessor(
            config, runner, self.scheduler, self.block_manager, self.spec, tokenizer
        )
        self.requests: dict[str, Request] = {}
        self._arrivals, self._num_steps = itertools.count(), 0
        self._pending_outputs: list[RequestOutput] = []
        self.meter = meter = StepMeter(clock, rates)
        self.overload = OverloadControl(config, scheduler, processor.finish, meter, self.requests)
        self.kv_accounting = KVAccounting(runner.kv_geometry())  # memory per request

    @property
    def tokenizer(self) -> Any:  # the output processor's, which detokenises with it
        return self.output_processor.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self.output_processor.tokenizer = tokenizer

    @property
    def model(self) -> LlamaModel:  # the runner's target model; tests wrap it to inject faults
        return self.model_runner.model

    @model.setter
    def model(self, model: LlamaModel) -> None:
        self.model_runner.model = model

    # -- public API ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        deadline_ms: int | None = None,
    ) -> None:
        """Queue a request. Raises EngineError for an unusable prompt or parameters or a
        duplicate id, and QueueFullError when it is refused (`core.overload`, as `deadline_ms`,
        its time from now). Requests share prefix-cache blocks only when their `cache_salt`s
        are equal (None too), so tenants with different salts never read each other's KV."""
        if request_id in self.requests:
            raise EngineError(f"Request id {request_id!r} is already in use.")
        prompt = check_prompt(
            prompt_token_ids,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
        )
        check_request(
            params,
            priority=priority,
            cache_salt=cache_salt,
            tenant=tenant,
            vocab_size=self.model_config.vocab_size,
            max_num_seqs=self.config.max_num_seqs,
            deadline_ms=deadline_ms,
        )
        processor = self.output_processor
        request = Request(
            request_id, prompt, params, int(priority), next(self._arrivals), cache_salt=cache_salt,
            tenant=tenant or "",
        )  # fmt: skip
        seq = processor.new_sequence(
            request, 0, list(prompt), processor.seeded_generator(params, 0)
        )
        seq.grammar = processor.grammar_matcher(params)  # may raise EngineError
        self._pending_outputs += self.overload.admit(seq, deadline_ms)  # may refuse it
        request.sequences.append(seq)
        self.requests[request_id] = request

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored. The next
        `step()` returns its final output with finish_reason "abort"."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self._pending_outputs.append(self.output_processor.finish(request, "abort"))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; returns outputs of the requests that progressed or
        ended otherwise (abort, "error", "shed", "deadline": `core.overload`); finished ones
        carry their memory per request (`core.kv_accounting`)."""
        return self.kv_accounting.annotate(self._step())

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        outputs += self.overload.expire()
        # Drafts first, so the scheduler counts them against the step's token budget.
        drafted = self.spec.propose(self.scheduler.running) if self.spec is not None else []
        try:
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return outputs
            self.block_manager.begin_step()
            self.meter.start()
            try:
                with torch.inference_mode():
                    self.model_runner.copy_blocks(batch.block_copies)
                    if drafted:
                        self.model_runner.fill_drafts(self.spec, batch.seqs)
                    items = list(zip(batch.seqs, batch.num_new_tokens, strict=True))
                    self.kv_accounting.observe(items, self.block_manager.ref_counts)
                    outputs += self._run(items)
            finally:
                self.block_manager.end_step()
        finally:
            for seq in drafted:
                seq.draft_token_ids, seq.draft_parents, seq.num_lookahead_tokens = [], None, 0
        self._num_steps += 1
        return outputs

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_blocks_total=bm.num_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_cached=bm.num_cached_blocks,
            kv_cache_usage=bm.num_used_blocks / bm.num_blocks,
            block_size=self.config.block_size,
            prefix_cache_query_tokens=self.scheduler.prefix_query_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            prompt_tokens_total=sum(self.meter.prompt_tokens.values()),
            generation_tokens_total=sum(self.meter.generation_tokens.values()),
            prompt_tokens_by_step_kind=dict(self.meter.prompt_tokens),
            generation_tokens_by_step_kind=dict(self.meter.generation_tokens),
            kv_bytes_per_token=self.model_runner.kv_bytes_per_token,
            kv_bytes_per_request=self.model_runner.kv_bytes_per_request,
            max_model_len=self.max_model_len,
            prefix_cache_preempted_query_tokens=self.scheduler.preempted_prefix_query_tokens,
            prefix_cache_preempted_hit_tokens=self.scheduler.preempted_prefix_hit_tokens,
            weight_bytes_by_kind=dict(self.model_runner.weight_bytes_by_kind),
            spec_decode=None if self.spec is None else self.spec.stats(),
            requests_shed_by_reason=dict(self.overload.counts),
            kv_memory=self.kv_accounting.gauges(),
            kv_eviction=bm.eviction_stats(),
        )

    # -- one step -----------------------------------------------------------------------------
    def _run(self, items: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """Execute `items`, bisecting by request when that raises; commit what succeeded and
        fail the requests that fail alone (or whose tokens could not be committed)."""
        try:
            executed = [self._execute(items)]
            failures: list[tuple[Request, Exception]] = []
        except Exception as exc:
            requests = list(dict.fromkeys(seq.request for seq, _ in items))
            executed, failures = isolate_failures(
                requests, lambda part: self._execute(items, part), exc
            )
        processor = self.output_processor
        outputs = [output for run in executed for output in processor.commit(run, failures)]
        outputs += [processor.fail(request, exc) for request, exc in failures]
        for output in outputs:
            if output.finished:
                self.requests.pop(output.request_id, None)
        self.meter.count(executed)
        return outputs

    def _execute(
        self, items: list[tuple[Sequence, int]], requests: list[Request] | None = None
    ) -> Executed:
        """Forward and sample `items` (those of `requests`, when given); changes nothing but
        the KV slots of their new tokens and, on success, the seeded generators of the rows
        that sampled."""
        if requests is not None:
            chosen = set(requests)
            items = [item for item in items if item[0].request in chosen]
        return self.output_processor.sample(self.model_runner.forward(items))
