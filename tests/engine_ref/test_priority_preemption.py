"""The `priority` policy's preemption and aging through `LLMEngine.step`: a better request
takes a seat or blocks from the worst running one (which recomputes and still produces the
same tokens), aging alone never preempts, and a low-priority request under a steady stream of
high-priority ones is admitted at the step worked out by hand (never, with aging off)."""

from __future__ import annotations

import pytest
from policy_util import PARAMS, finish_order, make, prompt

from engine_ref import EngineConfig, EngineConfigError, SamplingParams

FOUR = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _tokens(engine, steps=None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished() and (steps is None or steps > 0):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
        steps = None if steps is None else steps - 1
    return tokens


@pytest.mark.parametrize(
    ("policy", "order", "preemptions"),
    [("priority", ["high", "low"], 1), ("fcfs", ["low", "high"], 0)],
)
def test_a_better_request_takes_the_seat_of_the_worst_running_one(
    tiny_model, policy, order, preemptions
):
    """max_num_seqs 1: low (priority 5) runs two steps, then high (0) arrives and takes its
    seat in the next step; low is recomputed afterwards and its 4 greedy tokens are those of
    an undisturbed run. fcfs: high waits."""
    alone = make(tiny_model, policy)
    alone.add_request("low", prompt(6, 0), FOUR, priority=5)
    expected = _tokens(alone)["low"]
    engine = make(tiny_model, policy)
    engine.add_request("low", prompt(6, 0), FOUR, priority=5)
    tokens = _tokens(engine, steps=2)
    engine.add_request("high", prompt(6, 100), PARAMS, priority=0)
    done = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
            done += [out.request_id] if out.finished else []
    assert done == order
    assert tokens["low"] == expected
    assert engine.stats().num_preemptions == preemptions


@pytest.mark.parametrize(("high_priority", "displaced"), [(4, True), (5, False), (6, False)])
def test_a_better_request_takes_blocks_from_the_worst_running_one(
    tiny_model, high_priority, displaced
):
    """4 blocks of 4 tokens, seats for all. low (priority 5, 12 tokens) holds 3 blocks after
    its prefill; high (8 tokens, 2 blocks) finds 1 free. Priority 4 (just better) preempts
    low and finishes first; 5 (equal) and 6 (worse) wait for low's end."""
    engine = make(tiny_model, "priority", num_blocks=4, block_size=4, max_num_seqs=4)
    engine.add_request("low", prompt(12, 0), PARAMS, priority=5)
    engine.step()
    engine.add_request("high", prompt(8, 100), PARAMS, priority=high_priority)
    order = finish_order(engine)
    assert order == (["high", "low"] if displaced else ["low", "high"])
    assert engine.stats().num_preemptions == int(displaced)
    assert engine.stats().num_blocks_used == 0


@pytest.mark.parametrize(
    ("aging_steps", "admitted_at"), [(1, 5), (2, 9), (3, 9), (4, 13), (0, None)]
)
def test_aging_bounds_the_wait_of_a_low_priority_request(tiny_model, aging_steps, admitted_at):
    """max_num_seqs 1; low (priority 3) waits from step 0; before every step a new
    high-priority (0) request is added when none is waiting. Each high runs 2 steps, so a seat
    frees at odd steps, where the waiting high has waited 2 steps: its aged priority is
    -(2 // A), low's is 3 - s // A at step s, and low goes first when it is no worse (it
    arrived first). So low's first token comes at the first odd s with 3 - s // A <= -(2 // A):
    A = 1: 3 - s <= -2 from s = 5, step 5. A = 2: 3 - s // 2 <= -1 from s = 8, step 9.
    A = 3: 3 - s // 3 <= 0 from s = 9, step 9. A = 4: 3 - s // 4 <= 0 from s = 12, step 13.
    A = 0 (aging off, the negative control): the highs always win and low starves."""
    engine = make(tiny_model, "priority", priority_aging_steps=aging_steps)
    engine.add_request("low", prompt(6, 0), PARAMS, priority=3)
    first_token_step = None
    for step in range(1, 41):
        waiting_high = any(
            r.priority == 0 and r.sequences[0].status.value == "waiting"
            for r in engine.requests.values()
        )
        if not waiting_high:
            engine.add_request(f"h{step}", prompt(6, 7 * step), PARAMS, priority=0)
        for out in engine.step():
            if out.request_id == "low" and first_token_step is None:
                first_token_step = step
    assert first_token_step == admitted_at


@pytest.mark.parametrize(("priority", "preempts"), [(2, False), (1, True)])
def test_aging_alone_never_preempts(tiny_model, priority, preempts):
    """Aging 1 step a level, one seat. low (priority 3) is admitted at step 1, having waited
    1 step: it runs at 2. x arrives next; waiting, it ages to 1 at step 2, better than low's
    2, but only its own priority counts against a running request: 2 (equal) waits for low's
    end, 1 (just better) preempts it."""
    engine = make(tiny_model, "priority", priority_aging_steps=1)
    engine.add_request("low", prompt(6, 0), FOUR, priority=3)
    engine.step()
    engine.add_request("x", prompt(6, 100), PARAMS, priority=priority)
    assert finish_order(engine) == (["x", "low"] if preempts else ["low", "x"])
    assert engine.stats().num_preemptions == int(preempts)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_a_bad_aging_option_is_one_sentence(value):
    with pytest.raises(EngineConfigError, match="^priority_aging_steps must be"):
        EngineConfig(priority_aging_steps=value)
