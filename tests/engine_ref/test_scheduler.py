"""Scheduler: token budget, chunked prefill, decode-first ordering, max_num_seqs, preemption
victims under FCFS and priority, queue bound. Steps are simulated by hand (no model)."""

from __future__ import annotations

import pytest

from engine_ref.core.block_manager import BlockManager
from engine_ref.core.detokenizer import IncrementalDetokenizer
from engine_ref.core.engine_config import EngineConfig, SamplingParams
from engine_ref.core.scheduler import QueueFullError, Scheduler
from engine_ref.core.sequence import Request, Sequence, SequenceStatus

_count = iter(range(10**6))


def new_seq(prompt_len: int, priority: int = 0) -> Sequence:
    n = next(_count)
    tokens = list(range(1000 * n + 1, 1000 * n + 1 + prompt_len))  # distinct: no prefix hits
    request = Request(f"r{n}", tokens, SamplingParams(), priority, n)
    return Sequence(n, request, 0, list(tokens), prompt_len, IncrementalDetokenizer(str, []))


def make(num_blocks=64, block_size=4, **config) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, **config)
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


def finish_step(batch) -> None:
    """What the engine does after a forward: advance computed counts, append a token to every
    sequence that reached its end."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def plan(batch) -> list[tuple[str, int]]:
    return [
        (s.request.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
    ]


def test_chunked_prefill_under_token_budget():
    s = make(max_num_batched_tokens=10)
    a, b = new_seq(25), new_seq(3)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert plan(batch) == [(a.request.request_id, 10)]
    finish_step(batch)
    batch = s.schedule()
    assert plan(batch) == [(a.request.request_id, 10)]
    finish_step(batch)
    batch = s.schedule()  # a's last 5 tokens, then b's whole prompt (3): 8 <= 10
    assert plan(batch) == [(a.request.request_id, 5), (b.request.request_id, 3)]
    finish_step(batch)
    batch = s.schedule()  # both decode now, shorter context first (b at 3, a at 25)
    assert plan(batch) == [(b.request.request_id, 1), (a.request.request_id, 1)]


def test_decode_rows_come_first_and_are_not_starved_by_a_long_prefill():
    s = make(max_num_batched_tokens=8)
    a = new_seq(3)
    s.add(a)
    finish_step(s.schedule())  # a decodes from now on
    b = new_seq(30)
    s.add(b)
    for _ in range(3):
        batch = s.schedule()
        assert plan(batch) == [(a.request.request_id, 1), (b.request.request_id, 7)]
        finish_step(batch)


def test_without_chunking_a_prompt_waits_for_room_or_runs_alone():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    a, b = new_seq(4), new_seq(9)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert plan(batch) == [(a.request.request_id, 4)]  # b (9) does not fit beside a (4)
    finish_step(batch)
    assert plan(s.schedule()) == [(a.request.request_id, 1), (b.request.request_id, 9)]
    c = new_seq(40)  # longer than the budget: runs alone when nothing else is scheduled
    s2 = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s2.add(c)
    assert plan(s2.schedule()) == [(c.request.request_id, 40)]


def test_max_num_seqs():
    s = make(max_num_seqs=2)
    seqs = [new_seq(3) for _ in range(3)]
    for q in seqs:
        s.add(q)
    assert len(s.schedule().seqs) == 2 and s.num_waiting == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_picks_the_least_important_running_sequence(policy):
    # 6 blocks of 4 tokens. Three sequences of 7 tokens take 2 blocks each; the first decode
    # that crosses into a third block needs a block nobody has.
    s = make(num_blocks=6, max_num_batched_tokens=64, scheduling_policy=policy)
    a, b, c = new_seq(7, priority=0), new_seq(7, priority=9), new_seq(7, priority=1)
    for q in (a, b, c):
        s.add(q)
    finish_step(s.schedule())  # all three prefilled; each now has 8 tokens, 7 computed
    finish_step(s.schedule())  # decode position 7 fills each second block
    batch = s.schedule()  # position 8 needs a new block for each: one must go
    victim = c if policy == "fcfs" else b  # latest arrival vs largest priority value
    assert batch.num_preempted >= 1
    assert victim.status is SequenceStatus.WAITING and victim.block_table == []
    assert victim.num_computed_tokens == 0 and victim.num_tokens == 9
    assert victim not in batch.seqs and s.num_preemptions == batch.num_preempted


def test_preempted_sequence_goes_back_ahead_of_newer_arrivals():
    s = make(num_blocks=4, max_num_batched_tokens=64)
    a, b = new_seq(7), new_seq(7)
    s.add(a)
    s.add(b)
    finish_step(s.schedule())
    finish_step(s.schedule())
    s.schedule()  # b preempted
    late = new_seq(3)
    s.add(late)
    assert s._peek() is b


def test_queue_bound():
    s = make(max_waiting_requests=1)
    s.add(new_seq(3))
    with pytest.raises(QueueFullError):
        s.add(new_seq(3))


def test_remove_is_idempotent_and_frees_blocks():
    s = make(num_blocks=8)
    a = new_seq(10)
    s.add(a)
    s.schedule()
    assert s.block_manager.num_free_blocks == 5
    s.remove(a)
    s.remove(a)
    assert s.block_manager.num_free_blocks == 8 and s.num_running == 0
