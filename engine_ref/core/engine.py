"""`LLMEngine`: add requests, run scheduler iterations, abort, report stats.

One `step()` = schedule -> copy-on-write block copies -> one forward over the flattened batch
(decode rows and prefill chunks together) -> logits for the rows that sample -> sample ->
append tokens, detokenise, check stop conditions -> free finished sequences' blocks once the
step is over.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from engine_ref.core.attention import build_attention_metadata, kv_pool_shape
from engine_ref.core.block_manager import BlockManager, HashFn, default_hash
from engine_ref.core.detokenizer import IncrementalDetokenizer
from engine_ref.core.engine_config import EngineConfig, SamplingParams
from engine_ref.core.model import LlamaModel
from engine_ref.core.sampler import SampleRow, sample
from engine_ref.core.scheduler import ScheduledBatch, Scheduler
from engine_ref.core.sequence import Request, Sequence, SequenceStatus
from engine_ref.core.stats import EngineStats


class EngineError(ValueError):
    """A request the engine cannot serve (bad prompt, duplicate id, too long)."""


@dataclass
class CompletionOutput:
    """What one sequence produced in one step (`new_*`) and its totals so far."""

    index: int
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None
    num_output_tokens: int
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int


class LLMEngine:
    """The reference engine. `loaded` (an `engine_ref.loading.weights.LoadedModel`, or anything with
    `config`, `state_dict` and `tokenizer`) skips loading `config.model`. `hash_fn` replaces
    the prefix-cache hash (tests force collisions with it)."""

    def __init__(
        self, config: EngineConfig, *, loaded: Any = None, hash_fn: HashFn = default_hash
    ) -> None:
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise EngineError("CUDA is not available on this machine; use device='cpu'.")
        if self.device.type == "cpu":
            torch.set_num_threads(config.threads())
        if loaded is None:
            from engine_ref.loading.weights import load_model

            loaded = load_model(config.model, dtype=self.dtype)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        mc = self.model_config
        max_len = config.max_model_len or mc.max_position_embeddings
        self.model = LlamaModel.from_state_dict(
            mc, loaded.state_dict, dtype=self.dtype, device=self.device, max_positions=max_len
        )
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes_per_token = (
            2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * elem
        )
        bs = config.block_size
        num_blocks = config.num_blocks or config.kv_cache_memory_bytes // (
            self.kv_bytes_per_token * bs
        )
        if num_blocks < 2:
            raise EngineError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds fewer than 2 blocks; "
                "raise it or set num_blocks."
            )
        self.max_model_len = min(max_len, num_blocks * bs)
        # One pool per layer, head-major (see attention.py).
        # Zeroed, not empty: masked slots are multiplied by 0 and must not hold NaN.
        pool_shape = kv_pool_shape(num_blocks, bs, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches = [
            torch.zeros(pool_shape, dtype=self.dtype, device=self.device)
            for _ in range(mc.num_hidden_layers)
        ]
        self.block_manager = BlockManager(
            num_blocks,
            bs,
            enable_prefix_caching=config.enable_prefix_caching,
            salt=f"{config.prefix_cache_salt}|{self.tokenizer.name}|{config.model}|{self.dtype}",
            hash_fn=hash_fn,
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._num_steps = 0
        self._prompt_tokens: dict[str, int] = defaultdict(int)
        self._generation_tokens: dict[str, int] = defaultdict(int)

    # -- public API ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
    ) -> None:
        """Queue a request. Raises EngineError for an unusable prompt or a duplicate id, and
        QueueFullError when the waiting queue is at its bound."""
        if request_id in self.requests:
            raise EngineError(f"Request id {request_id!r} is already in use.")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise EngineError("The prompt has no tokens.")
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise EngineError(f"Prompt token ids must be in [0, {vocab}).")
        if len(prompt) >= self.max_model_len:
            raise EngineError(
                f"The prompt has {len(prompt)} tokens; this engine serves at most "
                f"{self.max_model_len - 1} (max_model_len {self.max_model_len})."
            )
        request = Request(request_id, prompt, params, priority, next(self._arrivals))
        seq = self._new_sequence(request, index=0, token_ids=list(prompt))
        self.scheduler.add(seq)  # may raise QueueFullError
        request.sequences.append(seq)
        self.requests[request_id] = request

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored. The next
        `step()` returns its final output with finish_reason "abort"."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        outputs = []
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
                outputs.append(CompletionOutput(seq.index, [], "", "abort", seq.num_output_tokens))
        self._pending_outputs.append(
            RequestOutput(
                request_id, outputs, True, len(request.prompt_token_ids), request.num_cached_tokens
            )
        )

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler iteration; returns outputs of the requests that progressed."""
        outputs, self._pending_outputs = self._pending_outputs, []
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        self.block_manager.begin_step()
        try:
            with torch.inference_mode():
                progressed = self._run(batch)
        finally:
            self.block_manager.end_step()
        self._num_steps += 1
        return outputs + progressed

    def stats(self) -> EngineStats:
        bm = self.block_manager
        bs = self.config.block_size
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_blocks_total=bm.num_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_cached=bm.num_cached_blocks,
            kv_cache_usage=bm.num_used_blocks / bm.num_blocks,
            block_size=bs,
            prefix_cache_query_tokens=bm.prefix_query_tokens,
            prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            prompt_tokens_total=sum(self._prompt_tokens.values()),
            generation_tokens_total=sum(self._generation_tokens.values()),
            prompt_tokens_by_step_kind=dict(self._prompt_tokens),
            generation_tokens_by_step_kind=dict(self._generation_tokens),
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_bytes_per_request=-(-self.max_model_len // bs) * bs * self.kv_bytes_per_token,
            max_model_len=self.max_model_len,
        )

    # -- one step -----------------------------------------------------------------------------
    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        self._copy_blocks(batch.block_copies)
        input_ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        num_prompt_rows = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            starts.append(start)
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            if start < seq.num_prompt_tokens or n > 1:
                num_prompt_rows += n
            if start + n == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampling_seqs.append(seq)
        meta = build_attention_metadata(
            start_positions=starts,
            num_new_tokens=batch.num_new_tokens,
            block_tables=[s.block_table for s in batch.seqs],
            block_size=self.config.block_size,
            num_queries_per_kv=self.model_config.num_attention_heads
            // self.model_config.num_key_value_heads,
            num_kv_heads=self.model_config.num_key_value_heads,
            num_pool_blocks=self.block_manager.num_blocks,
            device=self.device,
            dtype=self.dtype,
        )
        ids = torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        hidden = self.model(ids, pos, meta, self.kv_caches)  # [T, D]

        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)

        # A request with n > 1 forks when its prompt is done: its children sample from the
        # parent's logits row.
        logits_rows: list[int] = []
        rows_seqs: list[Sequence] = []
        for r, seq in enumerate(sampling_seqs):
            family = [seq, *self._fork(seq)] if seq.request.needs_fork else [seq]
            rows_seqs += family
            logits_rows += [r] * len(family)
        if len(sample_rows) < len(input_ids):
            hidden = hidden.index_select(0, torch.tensor(sample_rows, device=self.device))
        logits = self.model.compute_logits(hidden)  # [N, V]
        if len(logits_rows) != len(sample_rows):
            logits = logits.index_select(0, torch.tensor(logits_rows, device=self.device))
        result = sample(logits, [self._sample_row(s) for s in rows_seqs], self.generator)

        kind = "mixed" if num_prompt_rows and num_prompt_rows < len(input_ids) else None
        kind = kind or ("prefill" if num_prompt_rows else "decode")
        self._prompt_tokens[kind] += num_prompt_rows
        self._generation_tokens[kind] += len(rows_seqs)
        return self._append_tokens(rows_seqs, result.token_ids, result.logprobs)

    def _append_tokens(
        self,
        seqs: list[Sequence],
        token_ids: list[int],
        logprobs: list[dict[int, float] | None],
    ) -> list[RequestOutput]:
        by_request: dict[str, list[CompletionOutput]] = {}
        for seq, token, lp in zip(seqs, token_ids, logprobs, strict=True):
            seq.token_ids.append(token)
            if lp is not None:
                seq.logprobs = seq.logprobs or []
                seq.logprobs.append(lp)
            new_text = self._update_text_and_finish(seq, token)
            if seq.finish_reason is not None:
                self.scheduler.remove(seq)  # blocks freed when the step ends
            by_request.setdefault(seq.request.request_id, []).append(
                CompletionOutput(
                    seq.index,
                    [token],
                    new_text,
                    seq.finish_reason,
                    seq.num_output_tokens,
                    None if lp is None else [lp],
                )
            )
        outputs = []
        for request_id, completions in by_request.items():
            request = self.requests[request_id]
            finished = request.is_finished
            if finished:
                del self.requests[request_id]
            outputs.append(
                RequestOutput(
                    request_id,
                    completions,
                    finished,
                    len(request.prompt_token_ids),
                    request.num_cached_tokens,
                )
            )
        return outputs

    def _update_text_and_finish(self, seq: Sequence, token: int) -> str:
        """Detokenise the new token, decide whether the sequence is done, and return the text
        that can be released now (held back while it might still become a stop string)."""
        params = seq.request.params
        detok = seq.detokenizer
        detok.add([token])
        reason = None
        if token in params.stop_token_ids:
            reason = "stop"
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        text = detok.text
        end = len(text)
        stop_hit = False
        if params.stop:
            start = seq.num_emitted_chars
            hits = [p for p in (text.find(s, start) for s in params.stop) if p >= 0]
            if hits:
                reason, end, stop_hit = "stop", min(hits), True
            elif reason is None:
                # Hold back a tail that could still grow into a stop string.
                end = max(start, len(text) - max(len(s) for s in params.stop) + 1)
        if reason is not None and not stop_hit:
            text = text + detok.flush()
            end = len(text)
        new_text = text[seq.num_emitted_chars : end]
        seq.num_emitted_chars = end
        seq.finish_reason = reason
        return new_text

    # -- helpers ------------------------------------------------------------------------------
    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seed = request.params.seed
        generator = None
        if seed is not None and not request.params.is_greedy:
            generator = torch.Generator(self.device).manual_seed(seed + index * 1_000_003)
        decode = self.tokenizer.decode
        return Sequence(
            seq_id=next(self._seq_ids),
            request=request,
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(request.prompt_token_ids),
            detokenizer=IncrementalDetokenizer(decode, request.prompt_token_ids),
            generator=generator,
        )

    def _fork(self, parent: Sequence) -> list[Sequence]:
        request = parent.request
        request.is_forked = True
        children = []
        for index in range(1, request.params.n):
            child = self._new_sequence(request, index, list(parent.token_ids))
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.scheduler.running.append(child)
            request.sequences.append(child)
            children.append(child)
        return children

    def _sample_row(self, seq: Sequence) -> SampleRow:
        params = seq.request.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens:
            banned = tuple(self.eos_token_ids | set(params.stop_token_ids))
        return SampleRow(params, seq.generator, banned)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for pool in self.kv_caches:
            pool.index_copy_(1, dst, pool.index_select(1, src))
