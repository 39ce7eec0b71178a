"""Iteration-level scheduler: each step, running sequences first (one decode token each, plus
the tokens drafted for it when speculating, or their next prefill chunk), then waiting
sequences' prefill chunks fill the token budget.
When blocks run out, the least important running sequence is preempted by recompute (its blocks
are freed; it returns to the waiting queue and later recomputes prompt and outputs, usually
mostly from the prefix cache). A running sequence with nothing to compute (a beam whose
request waits for its other beams' logits) is skipped.

The policies (`engine_ref.core.policy`) give each sequence a key: admitted smallest first,
preempted largest first. Under "fcfs" (arrival index) and "edf" (deadline, then arrival) the
keys are fixed and the waiting queue is a heap, so a preempted sequence goes back ahead of
newer arrivals. Under "priority" (aged priority), "fair" (tenant counters) and "affinity"
(cached prefix blocks, bypass bound) the order changes while sequences wait, so the queue is
scanned for the next one. Under "fair" each scheduled row's positions are charged to its
tenant (prompt positions at the input cost, output positions at the output cost). Under
"priority" a waiting sequence that lacks a seat or blocks preempts the worst running one whose
aged priority is worse than its own priority (`_displace`), taking its row out of the step.

Prefix-cache counters count tokens once per admission, not per attempt: a waiting sequence is
looked up again every step until its blocks fit, but only the lookup that admits it counts.
As in vLLM, a preempted sequence's re-admission is counted apart (`preempted_prefix_*`), so a
victim finding its own blocks again does not inflate the hit rate of new requests.

With KV eviction (`engine_ref.core.kv_eviction`), each iteration first frees the blocks that have
left the running sequences' windows, so the step's allocations can reuse them.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine_ref.core.block_manager import BlockManager
from engine_ref.core.engine_config import EngineConfig
from engine_ref.core.kv_eviction import KVEviction
from engine_ref.core.overload import QueueFullError
from engine_ref.core.policy import (
    MOVING_ORDER_POLICIES,
    FairShare,
    affinity_pick,
    aged_priority,
    tenant_weights,
)
from engine_ref.core.sequence import Sequence, SequenceStatus

__all__ = ["QueueFullError", "ScheduledBatch", "Scheduler"]


@dataclass
class ScheduledBatch:
    """One step's work: sequences with their new-token counts, single-token rows first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.running: list[Sequence] = []
        self.policy = config.scheduling_policy
        self._waiting: list[tuple[float, int, int, Sequence]] = []  # a heap unless `_moving`
        self._moving = self.policy in MOVING_ORDER_POLICIES
        self._num_waiting = 0
        self._push_count = 0
        self._num_schedules = 0  # the aging clock of the "priority" policy
        self._cached_blocks: dict[Sequence, int] = {}  # "affinity": this step's lookups
        self.num_preemptions = 0
        # Tokens looked up in / served from the prefix cache at admission (see module doc).
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.preempted_prefix_query_tokens = 0
        self.preempted_prefix_hit_tokens = 0
        self.kv_eviction = KVEviction.of(config)  # None: exact KV
        self.fair = (
            FairShare(tenant_weights(config.tenant_weights))  # type: ignore[arg-type]
            if config.scheduling_policy == "fair"
            else None
        )

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raises QueueFullError at the bound."""
        if self._num_waiting >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"Waiting queue is full ({self.config.max_waiting_requests} requests); retry later."
            )
        if self.fair is not None:
            waiting = (e[3] for e in self._waiting if e[3].status is SequenceStatus.WAITING)
            active = [s.request.tenant for s in (*self.running, *waiting)]
            self.fair.arrive(seq.request.tenant, active)
        self._push(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (abort/finish); idempotent."""
        if seq.status is SequenceStatus.WAITING:
            self._num_waiting -= 1  # its heap entry is skipped when popped
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def has_work(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def waiting(self) -> Iterator[Sequence]:
        """The waiting sequences, in no particular order."""
        return (e[3] for e in self._waiting if e[3].status is SequenceStatus.WAITING)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        chunked = self.config.enable_chunked_prefill
        scheduled: list[tuple[Sequence, int]] = []
        copies: dict[Sequence, list[tuple[int, int]]] = {}
        self._num_schedules += 1
        self._cached_blocks.clear()
        if self.kv_eviction is not None:  # between steps: no step reads these blocks now
            self.kv_eviction.apply(self.running, bm)

        # Decode rows before running prefill chunks, so a long prompt never starves them.
        pending = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, *self.key(s)))
        pending.reverse()  # pop() from the end takes the next in order
        while pending and budget > 0:
            seq = pending.pop()
            if seq.num_uncomputed_tokens == 0:
                continue  # a beam waiting for its siblings' logits (beam search)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if seq.num_lookahead_tokens:
                num_new += self._fit_drafts(seq, num_new, budget, len(pending))
            while not bm.can_append(seq, num_new):
                # Preempt the least important sequence not yet scheduled (maybe seq itself).
                victim = max([*pending, seq], key=self.key)
                if victim is not seq:
                    pending.remove(victim)
                self.running.remove(victim)
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                copies[seq] = bm.append_slots(seq, num_new)
                scheduled.append((seq, num_new))
                budget -= num_new

        while budget > 0:
            full = len(self.running) >= self.config.max_num_seqs
            if full and self.policy != "priority":
                break  # only "priority" displaces for a seat: no need to find the next one
            seq = self._peek()
            if seq is None:
                break
            if full:
                freed = self._displace(seq, scheduled, batch)
                if freed is None:
                    break
                budget += freed
            cached = 0
            if seq.num_computed_tokens == 0 and not seq.block_table:
                cached = bm.allocate_prefix(seq)
            remaining = seq.num_uncomputed_tokens
            if remaining > budget and not chunked and scheduled:
                bm.free(seq)  # the whole prompt must fit: wait for an emptier step
                break
            num_new = min(remaining, budget) if chunked else remaining
            while not bm.can_append(seq, num_new):
                freed = self._displace(seq, scheduled, batch)
                if freed is None:
                    break
                budget += freed
            if not bm.can_append(seq, num_new):
                bm.free(seq)
                break
            self._pop(seq)
            self._count_prefix_lookup(seq, cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            copies[seq] = bm.append_slots(seq, num_new)
            scheduled.append((seq, num_new))
            budget -= num_new

        # Single-token rows first, by position: attention groups them by context length.
        scheduled.sort(
            key=lambda item: (item[1] != 1, item[0].num_computed_tokens * (item[1] == 1))
        )
        batch.seqs = [s for s, _ in scheduled]
        batch.num_new_tokens = [n for _, n in scheduled]
        batch.block_copies = [c for s in batch.seqs for c in copies.get(s, ())]
        if self.fair is not None:
            for seq, n in scheduled:
                prompt = max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
                self.fair.charge(seq.request.tenant, prompt, n - prompt)
        return batch

    def _displace(
        self, seq: Sequence, scheduled: list[tuple[Sequence, int]], batch: ScheduledBatch
    ) -> int | None:
        """Under "priority", preempt the worst running sequence when `seq`'s own priority is
        better than its aged one, taking its row (if any) out of this step; returns the tokens
        that row had (0 when it had none), or None when no sequence may be displaced."""
        if self.policy != "priority" or not self.running:
            return None
        victim = max(self.running, key=self.key)
        if not seq.request.priority < self.key(victim)[0]:
            return None
        self.running.remove(victim)
        freed = 0
        for i, (s, n) in enumerate(scheduled):
            if s is victim:
                del scheduled[i]
                freed = n
                break
        self._preempt(victim)
        batch.num_preempted += 1
        return freed

    def _fit_drafts(self, seq: Sequence, num_new: int, budget: int, num_pending: int) -> int:
        """How many of `seq`'s draft slots join its row (`num_lookahead_tokens` is cut to
        that): drafts take budget and blocks only when every running sequence not yet
        scheduled keeps one token and one block, so speculation never preempts or delays
        another running sequence."""
        spare = budget - num_new - num_pending
        num_draft = max(0, min(seq.num_lookahead_tokens, spare))
        bm = self.block_manager
        if num_draft and bm.blocks_needed(seq, num_new + num_draft) + num_pending > len(
            bm.free_blocks
        ):
            num_draft = 0
        seq.num_lookahead_tokens = num_draft
        return num_draft

    def _count_prefix_lookup(self, seq: Sequence, cached: int) -> None:
        if seq.num_preemptions:
            self.preempted_prefix_query_tokens += seq.num_tokens
            self.preempted_prefix_hit_tokens += cached
            return
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += cached
        if seq.index == 0:
            seq.request.num_cached_tokens = cached

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.beam_candidates = None  # its recompute gives them again
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._push(seq)

    def key(self, seq: Sequence) -> tuple[float, int]:
        """The policy's order: admitted smallest first, preempted largest first."""
        request = seq.request
        if self.fair is not None:
            return self.fair.key(request)
        if self.policy == "priority":
            waited = 0
            if seq.status is SequenceStatus.WAITING:
                waited = self._num_schedules - seq.waiting_since_step
            aging = self.config.priority_aging_steps
            priority = aged_priority(request.priority, seq.priority_credit, waited, aging)
            return priority, request.arrival_index
        if self.policy == "edf":
            deadline_s = request.deadline_s
            return float("inf") if deadline_s is None else deadline_s, request.arrival_index
        return 0, request.arrival_index

    def _push(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.waiting_since_step = self._num_schedules
        self._push_count += 1
        heapq.heappush(self._waiting, (*self.key(seq), self._push_count, seq))
        self._num_waiting += 1
        if len(self._waiting) > 2 * self._num_waiting + 64:
            # Entries of sequences that left while waiting (aborted, shed): drop them, so the
            # queue's memory follows what waits, not what was ever queued.
            self._waiting = [e for e in self._waiting if e[3].status is SequenceStatus.WAITING]
            heapq.heapify(self._waiting)

    def _peek(self) -> Sequence | None:
        if self._moving:  # the order moves while sequences wait: find the next by a scan
            self._waiting = [e for e in self._waiting if e[3].status is SequenceStatus.WAITING]
            if self.policy == "affinity":
                return affinity_pick(
                    (e[3] for e in self._waiting),
                    self._cached_prefix_blocks,
                    self.config.affinity_max_bypass,
                )
            if not self._waiting:
                return None
            return min(self._waiting, key=lambda e: (*self.key(e[3]), e[2]))[3]
        while self._waiting:
            seq = self._waiting[0][3]
            if seq.status is SequenceStatus.WAITING:
                return seq
            heapq.heappop(self._waiting)  # aborted while waiting
        return None

    def _pop(self, seq: Sequence) -> None:
        """Take `seq`, which `_peek` just returned, off the waiting queue."""
        if self.policy == "priority":  # it keeps the levels it earned waiting
            seq.priority_credit = seq.request.priority - int(self.key(seq)[0])
        if self._moving:
            self._waiting = [e for e in self._waiting if e[3] is not seq]
        else:
            heapq.heappop(self._waiting)
        self._num_waiting -= 1
        if self.policy == "affinity":  # every waiting earlier arrival was overtaken
            for other in self.waiting():
                if other.request.arrival_index < seq.request.arrival_index:
                    other.num_bypassed += 1

    def _cached_prefix_blocks(self, seq: Sequence) -> int:
        """How many of `seq`'s prompt blocks the prefix cache holds, counted once a step."""
        count = self._cached_blocks.get(seq)
        if count is None:
            count = self._cached_blocks[seq] = len(self.block_manager.cached_prefix(seq))
        return count
