"""`OutputProcessor`: from a forward's logits to each request's outputs.

It owns what follows from a request's parameters and text: the sequences it creates (each with
its incremental detokenizer and seeded generator), the guided-decoding grammars and the logits
masks they give, sampling and verifying drafts (`sample`, which commits nothing), and the
commit: computed counts advanced, full blocks entered into the prefix cache, forks, tokens
appended (grammars advanced by committed tokens only), a verify step's accepted tokens kept and
the rest rolled back, the text detokenised and held back while it may still become a stop
string, and finishing a sequence (stop, length, abort, error).
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine_ref.core import beam_search
from engine_ref.core.admission import EngineError
from engine_ref.core.beam_search import BeamHypothesis
from engine_ref.core.block_manager import BlockManager
from engine_ref.core.detokenizer import IncrementalDetokenizer
from engine_ref.core.engine_config import EngineConfig, SamplingParams
from engine_ref.core.grammar import GrammarBackend, GrammarError, GrammarMatcher
from engine_ref.core.model_runner import ForwardOutput, ModelRunner, device_index
from engine_ref.core.outputs import CompletionOutput, RequestOutput
from engine_ref.core.sampler import SampleRow, sample
from engine_ref.core.scheduler import Scheduler
from engine_ref.core.sequence import Request, Sequence, SequenceStatus
from engine_ref.core.spec_decode import Chain, SpeculativeDecoder, Verified, verify

__all__ = ["Executed", "OutputProcessor"]

logger = logging.getLogger(__name__)


@dataclass
class Executed:
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
    # Beam-search rows: (beam, its best continuations (token, log-probability)).
    beam_candidates: list[tuple[Sequence, list[tuple[int, float]]]] = field(default_factory=list)


class OutputProcessor:
    """Samples and commits for the engine whose `scheduler`, `block_manager` and `spec` it is
    given; `model_runner` moves a token tree's accepted KV. `tokenizer` detokenises and
    `eos_token_ids` stop (both replaceable, as tests do)."""

    def __init__(
        self,
        config: EngineConfig,
        model_runner: ModelRunner,
        scheduler: Scheduler,
        block_manager: BlockManager,
        spec: SpeculativeDecoder | None,
        tokenizer: Any,
    ) -> None:
        self.model_runner = model_runner
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.spec = spec
        self.tokenizer = tokenizer
        self.vocab_size = model_runner.model_config.vocab_size
        self.max_model_len = model_runner.max_model_len
        self.device = model_runner.device
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self._seq_ids = itertools.count()
        self._grammar_backend: GrammarBackend | None = None  # built at the first guided request

    # -- sequences ----------------------------------------------------------------------------
    def new_sequence(
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

    def seeded_generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sample `index`'s own generator when the request has a seed (torch takes seeds
        modulo 2**64, as it does negative ones)."""
        if params.seed is None or params.is_greedy:
            return None
        seed = (params.seed + index * 1_000_003) % 2**64
        return torch.Generator(self.device).manual_seed(seed)

    def grammar_matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A matcher at the start of the request's grammar (None when unconstrained); raises
        EngineError when the grammar cannot be compiled or the library is missing."""
        if params.guided is None:
            return None
        try:
            if self._grammar_backend is None:
                self._grammar_backend = GrammarBackend(
                    self.tokenizer, self.vocab_size, self.tokenizer.eos_token_ids
                )
            return self._grammar_backend.matcher(params.guided)
        except GrammarError as exc:
            raise EngineError(str(exc)) from None

    # -- sampling -----------------------------------------------------------------------------
    def sample(self, forward: ForwardOutput) -> Executed:
        """Mask, sample and verify `forward`'s logits; changes nothing but, on success, the
        seeded generators of the rows that sampled (a failure restores them, so a retry draws
        what this attempt drew)."""
        executed = Executed(forward.items, forward.num_prompt_rows)
        if forward.logits is None:
            return executed
        sampling_seqs = forward.sampling_seqs
        chains = [
            (seq, Chain(list(seq.draft_token_ids), self._sample_row(seq), parents=parents))
            for seq, parents in forward.verifying
        ]
        # A request with n > 1 forks when its prompt is done: its children sample from the
        # parent's logits row (they are created when the step commits).
        logits_rows: list[int] = []
        rows: list[SampleRow] = []
        beams: list[tuple[Sequence, int]] = []
        for r, seq in enumerate(sampling_seqs):
            if seq.request.params.use_beam_search:
                beams.append((seq, r))
                continue
            row = self._sample_row(seq)
            executed.samples.append((seq, seq.index, row.generator))
            rows.append(row)
            logits_rows.append(r)
            if seq.request.needs_fork:
                for index in range(1, seq.request.params.n):
                    generator = self.seeded_generator(seq.request.params, index)
                    executed.samples.append((seq, index, generator))
                    rows.append(replace(row, generator=generator))
                    logits_rows.append(r)
        all_logits = forward.logits  # [N + S, V]
        if self._grammar_backend is not None:
            all_logits = self._mask_logits(all_logits, sampling_seqs, chains)
        logits, spec_logits = all_logits[: len(sampling_seqs)], all_logits[len(sampling_seqs) :]
        if beams:
            executed.beam_candidates = beam_search.candidates(logits, beams, self.device)
        if len(logits_rows) != len(sampling_seqs):
            logits = logits.index_select(0, device_index(logits_rows, self.device))
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

    def _sample_row(self, seq: Sequence) -> SampleRow:
        params = seq.request.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens and seq.grammar is None:
            banned = tuple(self.eos_token_ids | set(params.stop_token_ids))
        return SampleRow(params, seq.generator, banned)

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

    # -- commit -------------------------------------------------------------------------------
    def commit(
        self, executed: Executed, failures: list[tuple[Request, Exception]]
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
        beam_outputs = self._commit_beams(executed, failures)
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
        return beam_outputs + [
            RequestOutput(
                request.request_id,
                completions,
                request.is_finished,
                len(request.prompt_token_ids),
                request.num_cached_tokens,
                kv_evicted_tokens=request.kv_evicted_tokens,
            )
            for request, completions in by_request.items()
        ]

    # -- beam search ----------------------------------------------------------------------------
    def _commit_beams(
        self, executed: Executed, failures: list[tuple[Request, Exception]]
    ) -> list[RequestOutput]:
        """Keep each beam's candidates; a request whose live beams all have theirs takes its
        beam step. Returns the outputs of the requests whose search ended."""
        requests: dict[Request, None] = {}
        for seq, candidates in executed.beam_candidates:
            seq.beam_candidates = candidates
            requests[seq.request] = None
        outputs = []
        for request in requests:
            live = [s for s in request.sequences if not s.is_finished]
            if request.beam_done or any(s.beam_candidates is None for s in live):
                continue  # a beam was preempted or cut from this step: wait for its row
            try:
                output = self._beam_step(request, live)
            except Exception as exc:
                failures.append((request, exc))
                continue
            if output is not None:
                outputs.append(output)
        return outputs

    def _beam_step(self, request: Request, live: list[Sequence]) -> RequestOutput | None:
        """One step of beam search (`engine_ref.core.beam_search`) over `live`, every beam
        with its candidates: forks, frees and appends; the answer when the search ends."""
        params = request.params
        width = params.beam_width
        chosen, finished = beam_search.rank(
            live, width, lambda token: self._ends_sequence(params, token)
        )
        request.beam_finished += finished
        for seq in live:
            seq.beam_candidates = None
        # Forks first: a child copies its parent's tokens before the parent appends its own.
        kept: set[Sequence] = set()
        targets = []
        for seq, token, score in chosen:
            if seq in kept:
                seq = self._fork(seq, request.next_index, None)
                request.next_index += 1
            kept.add(seq)
            targets.append((seq, token, score))
        for seq in live:
            if seq not in kept:
                self.scheduler.remove(seq)  # a pruned beam: blocks freed when the step ends
        for seq, token, score in targets:
            seq.token_ids.append(token)
            seq.beam_score = score
            if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                hypothesis = BeamHypothesis(tuple(seq.output_token_ids), score, "length")
                request.beam_finished.append(hypothesis)
                self.scheduler.remove(seq)
        remaining = [s for s in request.sequences if not s.is_finished]
        if len(request.beam_finished) < width and remaining:
            return None
        for seq in remaining:  # the search is over: beams still running are dropped
            self.scheduler.remove(seq)
        request.beam_done = True
        return beam_search.answer(request, self.tokenizer.decode)

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
            self.model_runner.move_accepted_kv(seq, start, verified.path[:num_kept])
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

    def _ends_sequence(self, params: SamplingParams, token: int) -> bool:
        """A stop token, or an end-of-sequence token unless `ignore_eos`."""
        return token in params.stop_token_ids or (
            token in self.eos_token_ids and not params.ignore_eos
        )

    def _update_text_and_finish(self, seq: Sequence, token: int) -> str:
        """Detokenise the new token, decide whether the sequence is done, and return the text
        that can be released now (held back while it might still become a stop string)."""
        params = seq.request.params
        detok = seq.detokenizer
        detok.add([token])
        reason = None
        if self._ends_sequence(params, token):
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

    def _fork(self, parent: Sequence, index: int, generator: torch.Generator | None) -> Sequence:
        """Child `index` of `parent`'s request, sharing its blocks."""
        request = parent.request
        request.is_forked = True
        child = self.new_sequence(request, index, list(parent.token_ids), generator)
        child.grammar = None if parent.grammar is None else parent.grammar.fork()
        child.priority_credit = parent.priority_credit  # the levels aging earned the request
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.scheduler.running.append(child)
        request.sequences.append(child)
        return child

    # -- finishing ----------------------------------------------------------------------------
    def finish(self, request: Request, reason: str, error: str | None = None) -> RequestOutput:
        """Finish every unfinished sequence of `request` with `reason` ("abort", "error", or
        overload control's "shed" and "deadline") and take it off the scheduler (its blocks
        free when the step ends)."""
        outputs = []
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish_reason = reason
                outputs.append(CompletionOutput(seq.index, [], "", reason, seq.num_output_tokens))
        return RequestOutput(
            request.request_id,
            outputs,
            True,
            len(request.prompt_token_ids),
            request.num_cached_tokens,
            error=error,
            kv_evicted_tokens=request.kv_evicted_tokens,
        )

    def fail(self, request: Request, exc: Exception) -> RequestOutput:
        """Finish `request` with finish_reason "error", its error one line naming `exc`."""
        detail = (str(exc).strip().splitlines() or [""])[0]
        error = f"The engine failed this request: {type(exc).__name__}: {detail}".rstrip(": ")
        logger.warning("request %r failed: %s", request.request_id, error, exc_info=exc)
        return self.finish(request, "error", error)
