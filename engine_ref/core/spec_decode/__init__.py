"""Speculative decoding: proposers draft tokens, the target verifies them in its step's one
forward (`verify`), the engine commits what was accepted and rolls back the rest.

`SpeculativeDecoder` owns the policy around a proposer: which sequences draft this step (per
request, within the remaining length, not while an off-switch holds), and the counters that
`/metrics` reports. The engine's step asks it for draft slots before scheduling, so drafted
tokens count against the step's token budget like any other row; n-gram drafts are known by
then, model drafts are made after scheduling (`fill_drafts`), in the slots the scheduler
granted, because a model drafter writes KV there.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_ref.core.engine_config import SpeculativeConfig
from engine_ref.core.sequence import Sequence
from engine_ref.core.spec_decode.ngram import DraftTree, propose_ngram, propose_ngram_tree
from engine_ref.core.spec_decode.verification import Chain, Verified, verify
from engine_ref.core.stats import SpecDecodeStats

__all__ = [
    "Chain",
    "DraftTree",
    "SpeculativeDecoder",
    "Verified",
    "propose_ngram",
    "propose_ngram_tree",
    "verify",
]

DraftForward = Callable[[list[Sequence], list[int], list[int]], list[int]]

# Weight of the latest verify step in a sequence's moving acceptance rate.
_ACCEPTANCE_EWMA_WEIGHT = 0.3


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        k = config.num_speculative_tokens
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * k
        self.num_steps_off_by_batch_size = 0
        self.num_paused_proposals = 0

    def propose(self, running: list[Sequence]) -> list[Sequence]:
        """Set `num_lookahead_tokens` (and, for n-gram, `draft_token_ids`) of the running
        sequences that draft this step; returns them (the engine clears both when the step
        ends)."""
        cap = self.config.disable_by_batch_size
        if cap is not None and len(running) > cap:
            self.num_steps_off_by_batch_size += 1
            return []
        drafted = []
        for seq in running:
            num_tokens = self._draft_budget(seq)
            if num_tokens < 1:
                continue
            if seq.spec_pause_steps:
                seq.spec_pause_steps -= 1
                self.num_paused_proposals += 1
                continue
            if self.config.method == "ngram" and self.config.num_tree_branches > 1:
                tree = propose_ngram_tree(
                    seq.token_ids,
                    min_n=self.config.prompt_lookup_min,
                    max_n=self.config.prompt_lookup_max,
                    num_tokens=num_tokens,
                    num_branches=self.config.num_tree_branches,
                )
                if tree is None:
                    continue
                seq.draft_token_ids, seq.draft_parents = tree.token_ids, tree.parents
                num_tokens = len(tree.token_ids)
            elif self.config.method == "ngram":
                draft = propose_ngram(
                    seq.token_ids,
                    min_n=self.config.prompt_lookup_min,
                    max_n=self.config.prompt_lookup_max,
                    num_tokens=num_tokens,
                )
                if not draft:
                    continue
                seq.draft_token_ids = draft
                num_tokens = len(draft)
            seq.num_lookahead_tokens = num_tokens
            drafted.append(seq)
        return drafted

    def fill_drafts(self, seqs: list[Sequence], next_tokens: DraftForward | None) -> None:
        """After scheduling, for the scheduled `seqs` with draft slots: cut n-gram drafts to
        the slots granted, or draft greedily with `next_tokens`, one position per call for
        every sequence still drafting. `next_tokens(seqs, token_ids, positions)` returns each
        sequence's argmax next token after `token_ids` at `positions`."""
        if self.config.method == "ngram":
            for seq in seqs:
                del seq.draft_token_ids[seq.num_lookahead_tokens :]
                if seq.draft_parents is not None:  # parents come first: still a tree
                    del seq.draft_parents[seq.num_lookahead_tokens :]
            return
        assert next_tokens is not None
        for seq in seqs:
            seq.draft_token_ids = []
        for j in range(max((s.num_lookahead_tokens for s in seqs), default=0)):
            rows = [s for s in seqs if s.num_lookahead_tokens > j]
            inputs = [s.draft_token_ids[-1] if j else s.token_ids[-1] for s in rows]
            positions = [s.num_tokens - 1 + j for s in rows]
            for seq, token in zip(rows, next_tokens(rows, inputs, positions), strict=True):
                seq.draft_token_ids.append(token)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Count one committed verify step of `seq`; pause its drafting when its moving
        acceptance rate falls below the configured break-even rate."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
        w = _ACCEPTANCE_EWMA_WEIGHT
        seq.spec_acceptance = (1 - w) * seq.spec_acceptance + w * (num_accepted / num_drafted)
        threshold = self.config.disable_below_acceptance_rate
        if seq.spec_acceptance < threshold and self.config.pause_steps:
            seq.spec_pause_steps = self.config.pause_steps
            seq.spec_acceptance = threshold  # one more bad step after the pause pauses again

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=tuple(self.num_accepted_tokens_per_pos),
            num_steps_off_by_batch_size=self.num_steps_off_by_batch_size,
            num_paused_proposals=self.num_paused_proposals,
        )

    def _draft_budget(self, seq: Sequence) -> int:
        """Draft tokens `seq` may take this step: none unless it is a plain decode row of a
        request that allows speculation; at most what it can still emit minus the token the
        verify step adds, and no position past max_model_len."""
        params = seq.request.params
        if not params.speculative or seq.num_uncomputed_tokens != 1 or seq.request.needs_fork:
            return 0
        if seq.num_output_tokens < params.min_tokens:
            return 0  # the sampler bans end-of-sequence ids there; verify rows do not
        remaining = params.max_tokens - seq.num_output_tokens - 1
        return min(
            self.config.num_speculative_tokens, remaining, self.max_model_len - seq.num_tokens
        )
