"""`LLMEngine`: add requests, run scheduler iterations, abort, report stats.

One `step()` = schedule -> copy-on-write block copies -> execute: one forward over the
flattened batch (decode rows and prefill chunks together), logits for the rows that sample,
masked by each guided request's grammar (speculative rows by the grammar's state after the
drafted tokens before them), sample -> commit: advance computed counts, enter full blocks
into the prefix cache, fork, append tokens (advancing grammars by committed tokens only),
detokenise, check stop conditions -> free finished sequences' blocks once the step is over.

Execution commits nothing, so a step whose execution raises can be retried on part of its
batch: the engine bisects the batch by request until the requests that fail on their own are
found, fails only those (finish_reason "error", `RequestOutput.error` saying why) and commits
the rest. The retries rewrite the same KV slots (each sequence writes only positions past its
computed tokens, in blocks it alone holds) and restore seeded generators, so the others'
tokens are those of a step without the failed requests. A step that does not fail pays
nothing for this.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine_ref.core.admission import EngineError, check_prompt, check_request
from engine_ref.core.attention import build_attention_metadata, kv_pool_shape
from engine_ref.core.block_manager import BlockManager, HashFn, default_hash
from engine_ref.core.detokenizer import IncrementalDetokenizer
from engine_ref.core.engine_config import EngineConfig, SamplingParams
from engine_ref.core.grammar import GrammarBackend, GrammarError, GrammarMatcher
from engine_ref.core.isolation import isolate_failures
from engine_ref.core.model import LlamaModel
from engine_ref.core.outputs import CompletionOutput, RequestOutput
from engine_ref.core.quant import QuantizationError, weight_bytes_by_kind
from engine_ref.core.sampler import SampleRow, sample
from engine_ref.core.scheduler import Scheduler
from engine_ref.core.sequence import Request, Sequence, SequenceStatus
from engine_ref.core.spec_decode import Chain, DraftTree, SpeculativeDecoder, Verified, verify
from engine_ref.core.spec_decode.drafter import ModelDrafter, load_draft_model
from engine_ref.core.stats import EngineStats

__all__ = ["CompletionOutput", "EngineError", "LLMEngine", "RequestOutput"]

logger = logging.getLogger(__name__)


@dataclass
class _Executed:
    """A forward and sampling over `items` ((sequence, new tokens) in batch order), nothing
    committed yet. `samples[i]` is (the sequence whose logits row sampled, the sample index it
    is for, its generator): the index differs from the sequence's own for the children a
    request with n > 1 forks at its first token."""

    items: list[tuple[Sequence, int]]
    num_prompt_rows: int
    samples: list[tuple[Sequence, int, torch.Generator | None]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # Speculative rows: (sequence, its verified draft); `num_spec_tokens` counts the tokens
    # the commit appended from them (a stop can cut a verify step's tokens short).
    verified: list[tuple[Sequence, Chain, Verified]] = field(default_factory=list)
    num_spec_tokens: int = 0


def release_freed_heap() -> None:
    """Return the malloc heap's free pages to the system (glibc's `malloc_trim`, ~1 ms; a
    no-op elsewhere). No gc.collect(): the load's tensors go by reference counting, and a
    collection in a process with a large heap costs hundreds of ms."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class LLMEngine:
    """The reference engine. `loaded` (an `engine_ref.loading.weights.LoadedModel`, or anything with
    `config`, `state_dict` and `tokenizer`) skips loading `config.model`. `hash_fn` replaces
    the prefix-cache hash (tests force collisions with it)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: Any = None,
        hash_fn: HashFn = default_hash,
        draft_loaded: Any = None,
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

            keep_int4 = config.quantization == "w4a16"
            loaded = load_model(config.model, dtype=self.dtype, keep_int4=keep_int4)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        mc = self.model_config
        max_len = config.max_model_len or mc.max_position_embeddings
        try:
            self.model = LlamaModel.from_state_dict(
                mc,
                loaded.state_dict,
                dtype=self.dtype,
                device=self.device,
                max_positions=max_len,
                quantization=config.quantization,
                int4_weights=getattr(loaded, "int4_weights", None),
            )
        except QuantizationError as exc:
            raise EngineError(str(exc)) from None
        self.weight_bytes_by_kind = weight_bytes_by_kind(self.model)
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
        spec = config.speculative_config
        if spec is not None and spec.method == "self_draft":
            if spec.num_draft_layers > mc.num_hidden_layers:
                raise EngineError(
                    f"num_draft_layers={spec.num_draft_layers} exceeds the model's "
                    f"{mc.num_hidden_layers} layers; use at most that many."
                )
        self.spec = (
            None if spec is None else SpeculativeDecoder(spec, max_model_len=self.max_model_len)
        )
        self.drafter: ModelDrafter | None = None
        if spec is not None and spec.method == "self_draft":
            layers = spec.num_draft_layers
            self.drafter = ModelDrafter(
                self.model, self.kv_caches[:layers], mc, self._metadata, num_layers=layers
            )
        elif spec is not None and spec.method == "draft_model":
            model, caches, draft_config = load_draft_model(
                spec.model,
                draft_loaded,
                target_tokenizer=self.tokenizer,
                target_vocab_size=mc.vocab_size,
                num_blocks=num_blocks,
                block_size=bs,
                max_positions=self.max_model_len,
                dtype=self.dtype,
                device=self.device,
            )
            self.drafter = ModelDrafter(model, caches, draft_config, self._metadata, owns_kv=True)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seq_ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._num_steps = 0
        self._prompt_tokens: dict[str, int] = defaultdict(int)
        self._generation_tokens: dict[str, int] = defaultdict(int)
        self._grammar_backend: GrammarBackend | None = None  # built at the first guided request
        # Loading (dequantising, fusing, quantising) frees hundreds of MB of temporaries in
        # the middle of the malloc heap, which glibc keeps; hand them back (on SmolLM2 W4A16
        # the engine's RSS went from 2.7 to 1.6 GB, 1 GB of it the KV pool).
        del loaded, draft_loaded
        release_freed_heap()

    # -- public API ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises EngineError for an unusable prompt or parameters or a
        duplicate id, and QueueFullError when the waiting queue is at its bound. Requests
        share prefix-cache blocks only when their `cache_salt`s are equal (None included), so
        tenants with different salts never read each other's KV."""
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
            vocab_size=self.model_config.vocab_size,
            max_num_seqs=self.config.max_num_seqs,
        )
        grammar = self._grammar_matcher(params)
        request = Request(
            request_id, prompt, params, int(priority), next(self._arrivals), cache_salt=cache_salt
        )
        generator = self._seeded_generator(params, 0)
        seq = self._new_sequence(request, 0, list(prompt), generator)
        seq.grammar = grammar
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
        """Run one scheduler iteration; returns outputs of the requests that progressed, and
        of those that finished by abort or failed (finish_reason "error")."""
        outputs, self._pending_outputs = self._pending_outputs, []
        # Drafts first, so the scheduler counts them against the step's token budget.
        drafted = self.spec.propose(self.scheduler.running) if self.spec is not None else []
        try:
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return outputs
            self.block_manager.begin_step()
            try:
                with torch.inference_mode():
                    self._copy_blocks(batch.block_copies)
                    if drafted:
                        self._fill_drafts([s for s in batch.seqs if s.num_lookahead_tokens])
                    items = list(zip(batch.seqs, batch.num_new_tokens, strict=True))
                    outputs += self._run(items)
            finally:
                self.block_manager.end_step()
        finally:
            for seq in drafted:
                seq.draft_token_ids = []
                seq.draft_parents = None
                seq.num_lookahead_tokens = 0
        self._num_steps += 1
        return outputs

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
            prefix_cache_query_tokens=self.scheduler.prefix_query_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            prompt_tokens_total=sum(self._prompt_tokens.values()),
            generation_tokens_total=sum(self._generation_tokens.values()),
            prompt_tokens_by_step_kind=dict(self._prompt_tokens),
            generation_tokens_by_step_kind=dict(self._generation_tokens),
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_bytes_per_request=-(-self.max_model_len // bs) * bs * self.kv_bytes_per_token,
            max_model_len=self.max_model_len,
            prefix_cache_preempted_query_tokens=self.scheduler.preempted_prefix_query_tokens,
            prefix_cache_preempted_hit_tokens=self.scheduler.preempted_prefix_hit_tokens,
            weight_bytes_by_kind=dict(self.weight_bytes_by_kind),
            spec_decode=None if self.spec is None else self.spec.stats(),
        )

    # -- one step -----------------------------------------------------------------------------
    def _run(self, items: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        try:
            executed = [self._execute(items)]
            failures: list[tuple[Request, Exception]] = []
        except Exception as exc:
            requests = list(dict.fromkeys(seq.request for seq, _ in items))
            executed, failures = isolate_failures(
                requests, lambda part: self._execute_requests(items, part), exc
            )
        outputs = []
        for run in executed:
            outputs += self._commit(run, failures)
        outputs += [self._fail(request, exc) for request, exc in failures]
        self._count_tokens(executed)
        return outputs

    def _fill_drafts(self, seqs: list[Sequence]) -> None:
        """Draft into the scheduled slots. A drafter that fails costs its speedup, never an
        output: verification is lossless whatever the drafts, so they become copies of the
        last token."""
        assert self.spec is not None
        try:
            assert self.drafter is not None or self.spec.config.method == "ngram"
            next_tokens = self.drafter.next_tokens if self.drafter is not None else None
            self.spec.fill_drafts(seqs, next_tokens)
        except Exception:
            logger.warning("the draft model failed; drafting the last token", exc_info=True)
            for seq in seqs:
                seq.draft_token_ids = [seq.token_ids[-1]] * seq.num_lookahead_tokens

    def _metadata(
        self,
        starts: list[int],
        num_new_tokens: list[int],
        block_tables: list[list[int]],
        mc: Any = None,
        tree_masks: dict[int, torch.Tensor] | None = None,
    ):
        """Attention metadata for the target (or the model config `mc`'s heads)."""
        mc = mc or self.model_config
        return build_attention_metadata(
            start_positions=starts,
            num_new_tokens=num_new_tokens,
            block_tables=block_tables,
            block_size=self.config.block_size,
            num_queries_per_kv=mc.num_attention_heads // mc.num_key_value_heads,
            num_kv_heads=mc.num_key_value_heads,
            num_pool_blocks=self.block_manager.num_blocks,
            device=self.device,
            dtype=self.dtype,
            tree_masks=tree_masks,
        )

    def _execute_requests(
        self, items: list[tuple[Sequence, int]], requests: list[Request]
    ) -> _Executed:
        chosen = set(requests)
        return self._execute([item for item in items if item[0].request in chosen])

    def _execute(self, items: list[tuple[Sequence, int]]) -> _Executed:
        """Forward and sample `items`; changes nothing but the KV slots of their new tokens
        and, on success, the seeded generators of the rows that sampled."""
        input_ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        num_new_tokens: list[int] = []
        sample_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        spec_rows: list[int] = []
        chains: list[tuple[Sequence, Chain]] = []
        tree_masks: dict[int, torch.Tensor] = {}
        num_prompt_rows = 0
        for item_index, (seq, n) in enumerate(items):
            start = seq.num_computed_tokens
            starts.append(start)
            num_new_tokens.append(n)
            if seq.draft_token_ids and n > 1 and start == seq.num_tokens - 1:
                # A verify row: the last token, then the drafts; every row's logits count.
                assert len(seq.draft_token_ids) == n - 1
                spec_rows += range(len(input_ids), len(input_ids) + n)
                input_ids += [seq.token_ids[start], *seq.draft_token_ids]
                parents = seq.draft_parents
                if parents is None:
                    positions += range(start, start + n)
                else:  # a token tree: nodes at their depth's position, in consecutive slots
                    tree = DraftTree(seq.draft_token_ids, parents)
                    positions += [start, *(start + d for d in tree.depths)]
                    tree_masks[item_index] = torch.tensor(tree.ancestry_mask())
                    parents = list(parents)
                chain = Chain(list(seq.draft_token_ids), self._sample_row(seq), parents=parents)
                chains.append((seq, chain))
                continue
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            if start < seq.num_prompt_tokens or n > 1:
                num_prompt_rows += n
            if start + n == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampling_seqs.append(seq)
        tables = [seq.block_table for seq, _ in items]
        meta = self._metadata(starts, num_new_tokens, tables, tree_masks=tree_masks)
        ids = torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        hidden = self.model(ids, pos, meta, self.kv_caches)  # [T, D]
        if self.drafter is not None:  # a draft model keeps its KV of every computed position
            self.drafter.follow(ids, pos, starts, num_new_tokens, tables)
        executed = _Executed(items, num_prompt_rows)
        if not sampling_seqs and not chains:  # prefill chunks that end inside their prompts
            return executed

        # A request with n > 1 forks when its prompt is done: its children sample from the
        # parent's logits row (they are created when the step commits).
        logits_rows: list[int] = []
        rows: list[SampleRow] = []
        for r, seq in enumerate(sampling_seqs):
            row = self._sample_row(seq)
            executed.samples.append((seq, seq.index, row.generator))
            rows.append(row)
            logits_rows.append(r)
            if seq.request.needs_fork:
                for index in range(1, seq.request.params.n):
                    generator = self._seeded_generator(seq.request.params, index)
                    executed.samples.append((seq, index, generator))
                    rows.append(replace(row, generator=generator))
                    logits_rows.append(r)
        wanted_rows = sample_rows + spec_rows
        if len(wanted_rows) < len(input_ids):
            hidden = hidden.index_select(0, self._index(wanted_rows))
        all_logits = self.model.compute_logits(hidden)  # [N + S, V]
        if self._grammar_backend is not None:
            all_logits = self._mask_logits(all_logits, sampling_seqs, chains)
        logits, spec_logits = all_logits[: len(sample_rows)], all_logits[len(sample_rows) :]
        if len(logits_rows) != len(sample_rows):
            logits = logits.index_select(0, self._index(logits_rows))
        generators = [r.generator for r in rows] + [c.row.generator for _, c in chains]
        saved = [(g, g.get_state()) for g in generators if g is not None]
        try:
            if rows:
                result = sample(logits, rows, self.generator)
                executed.token_ids, executed.logprobs = result.token_ids, result.logprobs
            if chains:
                verified = verify(spec_logits, [c for _, c in chains], self.generator)
                executed.verified = [
                    (seq, chain, v) for (seq, chain), v in zip(chains, verified, strict=True)
                ]
        except Exception:
            for generator, state in saved:  # a retry must draw what this attempt drew
                generator.set_state(state)
            raise
        return executed

    def _commit(
        self, executed: _Executed, failures: list[tuple[Request, Exception]]
    ) -> list[RequestOutput]:
        """Advance computed counts, register full blocks, fork, append the sampled tokens. A
        request whose token cannot be appended (its detokenisation raised, say) joins
        `failures` instead of returning an output."""
        verifying = {seq for seq, _, _ in executed.verified}
        for seq, n in executed.items:
            if seq in verifying:
                continue  # its computed count depends on what was accepted
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
        # Fork before any token is appended: children copy the parent's tokens so far.
        targets = [
            seq if index == seq.index else self._fork(seq, index, generator)
            for seq, index, generator in executed.samples
        ]
        # Sampled tokens first, then verified speculative chains; each a call that may fail
        # for its request alone (`verified` marks the calls whose tokens were speculated).
        jobs = [
            (seq, False, functools.partial(self._append_token, seq, token, lp))
            for seq, token, lp in zip(targets, executed.token_ids, executed.logprobs, strict=True)
        ]
        jobs += [
            (seq, True, functools.partial(self._commit_verified, seq, chain, verified))
            for seq, chain, verified in executed.verified
        ]
        by_request: dict[Request, list[CompletionOutput]] = {}
        failed: set[Request] = set()
        for seq, speculated, job in jobs:
            request = seq.request
            if request in failed:
                continue
            try:
                completion = job()
            except Exception as exc:
                failures.append((request, exc))
                failed.add(request)
                by_request.pop(request, None)
                continue
            if speculated:
                executed.num_spec_tokens += len(completion.new_token_ids)
            by_request.setdefault(request, []).append(completion)
        outputs = []
        for request, completions in by_request.items():
            finished = request.is_finished
            if finished:
                del self.requests[request.request_id]
            outputs.append(
                RequestOutput(
                    request.request_id,
                    completions,
                    finished,
                    len(request.prompt_token_ids),
                    request.num_cached_tokens,
                )
            )
        return outputs

    def _append_token(
        self, seq: Sequence, token: int, lp: dict[int, float] | None
    ) -> CompletionOutput:
        if seq.grammar is not None:
            seq.grammar.accept(token)
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs = seq.logprobs or []
            seq.logprobs.append(lp)
        new_text = self._update_text_and_finish(seq, token)
        if seq.finish_reason is not None:
            self.scheduler.remove(seq)  # blocks freed when the step ends
        return CompletionOutput(
            seq.index,
            [token],
            new_text,
            seq.finish_reason,
            seq.num_output_tokens,
            None if lp is None else [lp],
        )

    def _commit_verified(self, seq: Sequence, chain: Chain, verified: Verified) -> CompletionOutput:
        """Commit a verify step: append its tokens one by one (detokenised, stop-checked) up
        to the first that finishes the sequence, then roll back what was rejected. Computed
        tokens become the last token plus the accepted drafts that were appended; the KV the
        verify forward wrote past them is garbage the next step overwrites, and the blocks
        holding only such positions are freed. Blocks are registered in the prefix cache from
        computed tokens only, so a rejected token never enters it."""
        start = seq.num_computed_tokens
        tokens: list[int] = []
        texts: list[str] = []
        logprobs: list[dict[int, float]] = []
        for j, token in enumerate(verified.token_ids):
            lp = None if verified.logprobs is None else verified.logprobs[j]
            if seq.grammar is not None:  # accepted tokens only: the rejected never get here
                seq.grammar.accept(token)
            seq.token_ids.append(token)
            if lp is not None:
                seq.logprobs = seq.logprobs or []
                seq.logprobs.append(lp)
                logprobs.append(lp)
            tokens.append(token)
            texts.append(self._update_text_and_finish(seq, token))
            if seq.finish_reason is not None:
                break
        num_kept = min(verified.num_accepted, len(tokens))
        if chain.parents is not None:
            self._move_accepted_kv(seq, start, verified.path[:num_kept])
        seq.num_computed_tokens = start + 1 + num_kept
        self.block_manager.register_full_blocks(seq)
        self.block_manager.trim(seq, seq.num_tokens)
        assert self.spec is not None
        self.spec.record(seq, len(chain.draft_token_ids), verified.num_accepted)
        if seq.finish_reason is not None:
            self.scheduler.remove(seq)  # blocks freed when the step ends
        return CompletionOutput(
            seq.index,
            tokens,
            "".join(texts),
            seq.finish_reason,
            seq.num_output_tokens,
            logprobs if verified.logprobs is not None else None,
        )

    def _move_accepted_kv(self, seq: Sequence, start: int, path: list[int]) -> None:
        """A token tree's accepted path: node i's KV was written at slot start + 1 + i; the
        sequence needs its j-th accepted token's at start + 1 + j (j <= i, so no move
        overwrites a source still to be read)."""
        moves = [(start + 1 + node, start + 1 + j) for j, node in enumerate(path) if node != j]
        if not moves:
            return
        bs = self.config.block_size
        table = seq.block_table

        def slot(pos: int) -> int:
            return table[pos // bs] * bs + pos % bs

        src = self._index([slot(s) for s, _ in moves])
        dst = self._index([slot(d) for _, d in moves])
        for pool in self.kv_caches:
            flat = pool.view(pool.shape[0], -1, pool.shape[-1])  # [2 * kvh, slots, hd]
            flat.index_copy_(1, dst, flat.index_select(1, src))

    def _fail(self, request: Request, exc: Exception) -> RequestOutput:
        """Finish every sequence of `request` with finish_reason "error" and free its blocks."""
        detail = (str(exc).strip().splitlines() or [""])[0]
        error = f"The engine failed this request: {type(exc).__name__}: {detail}".rstrip(": ")
        logger.warning("request %r failed: %s", request.request_id, error, exc_info=exc)
        outputs = []
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish_reason = "error"
                outputs.append(CompletionOutput(seq.index, [], "", "error", seq.num_output_tokens))
        self.requests.pop(request.request_id, None)
        return RequestOutput(
            request.request_id,
            outputs,
            True,
            len(request.prompt_token_ids),
            request.num_cached_tokens,
            error=error,
        )

    def _count_tokens(self, executed: list[_Executed]) -> None:
        num_prompt_rows = sum(run.num_prompt_rows for run in executed)
        num_rows = sum(n for run in executed for _, n in run.items)
        kind = "mixed" if num_prompt_rows and num_prompt_rows < num_rows else None
        kind = kind or ("prefill" if num_prompt_rows else "decode")
        self._prompt_tokens[kind] += num_prompt_rows
        self._generation_tokens[kind] += sum(
            len(run.token_ids) + run.num_spec_tokens for run in executed
        )

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
        elif seq.grammar is not None and seq.grammar.is_terminated:
            reason = "stop"  # the grammar is complete (it accepted an end-of-sequence token)
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
    def _new_sequence(
        self, request: Request, index: int, token_ids: list[int], generator: torch.Generator | None
    ) -> Sequence:
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

    def _seeded_generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sample `index`'s own generator when the request has a seed (torch takes seeds
        modulo 2**64, as it does negative ones)."""
        if params.seed is None or params.is_greedy:
            return None
        seed = (params.seed + index * 1_000_003) % 2**64
        return torch.Generator(self.device).manual_seed(seed)

    def _fork(self, parent: Sequence, index: int, generator: torch.Generator | None) -> Sequence:
        """Child `index` of `parent`'s request, sharing its blocks."""
        request = parent.request
        request.is_forked = True
        child = self._new_sequence(request, index, list(parent.token_ids), generator)
        child.grammar = None if parent.grammar is None else parent.grammar.fork()
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.scheduler.running.append(child)
        request.sequences.append(child)
        return child

    def _sample_row(self, seq: Sequence) -> SampleRow:
        params = seq.request.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens and seq.grammar is None:
            banned = tuple(self.eos_token_ids | set(params.stop_token_ids))
        return SampleRow(params, seq.generator, banned)

    def _grammar_matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A matcher at the start of the request's grammar (None when unconstrained); raises
        EngineError when the grammar cannot be compiled or the library is missing."""
        if params.guided is None:
            return None
        try:
            if self._grammar_backend is None:
                self._grammar_backend = GrammarBackend(
                    self.tokenizer, self.model_config.vocab_size, self.tokenizer.eos_token_ids
                )
            return self._grammar_backend.matcher(params.guided)
        except GrammarError as exc:
            raise EngineError(str(exc)) from None

    def _mask_logits(
        self,
        logits: torch.Tensor,
        sampling_seqs: list[Sequence],
        chains: list[tuple[Sequence, Chain]],
    ) -> torch.Tensor:
        """The step's logits [N + S, V] (N sampling rows, then each chain's k + 1 rows) with
        the tokens each constrained row's grammar disallows at -inf. A chain's row j is masked
        by the grammar's state after its first j drafted tokens (`draft_masks` walks the
        matcher through them and back); no matcher's state changes."""
        backend = self._grammar_backend
        assert backend is not None
        rows: list[int] = []
        bitmask: torch.Tensor | None = None
        for r, seq in enumerate(sampling_seqs):
            if seq.grammar is not None:
                bitmask = backend.allocate(logits.shape[0]) if bitmask is None else bitmask
                seq.grammar.fill(bitmask, r)
                rows.append(r)
        at = len(sampling_seqs)
        for seq, chain in chains:
            k = len(chain.draft_token_ids)
            if seq.grammar is not None:
                bitmask = backend.allocate(logits.shape[0]) if bitmask is None else bitmask
                seq.grammar.draft_masks(bitmask, at, chain.draft_token_ids, chain.parents)
                rows += range(at, at + k + 1)
            at += k + 1
        if bitmask is None:
            return logits
        logits = logits.float()  # the sampler computes in float32 anyway
        backend.apply(logits, bitmask, rows)
        return logits

    def _index(self, rows: list[int]) -> torch.Tensor:
        # dtype explicit: torch.tensor([]) is float32, which index_select rejects.
        return torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = self._index([s for s, _ in copies])
        dst = self._index([d for _, d in copies])
        for pool in self.kv_caches:
            pool.index_copy_(1, dst, pool.index_select(1, src))
