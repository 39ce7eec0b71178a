"""Scheduling policies: which waiting sequence the scheduler admits next, which running one it
preempts first when blocks run out, and the per-tenant accounts the `fair` policy keeps.

- `fcfs`: arrival order.
- `priority`: lower `priority` first (vLLM's convention), then arrival. A waiting request
  gains one level for every `EngineConfig.priority_aging_steps` scheduler steps it has waited
  (aging; 0 turns it off), and keeps what it gained once admitted (so a preemption does not
  cost it its place), which bounds starvation: a waiting request of priority p + d goes ahead
  of every priority-p request that arrived more than (d + 1) x `priority_aging_steps` steps
  after it, so it waits a bounded time however many keep arriving (with the queue kept short,
  it is at the head after about that many steps, and admitted at the next free seat).
  A waiting request whose own `priority` is better than a running one's (aged) priority
  preempts the worst running sequence (by recompute) when it lacks a seat (`max_num_seqs`) or
  blocks; aging alone never preempts, so two requests cannot take turns evicting each other.
- `edf`: earliest deadline first. Waiting requests are ordered by absolute deadline, those
  without one after all that have one, then by arrival; under block pressure the latest
  deadline (or no deadline) is preempted first. `add_request` refuses a request whose deadline
  its estimate says cannot be met (`engine_ref.core.deadline`).
- `fair`: per-tenant fair share of the tokens served, by virtual token counters (Sheng et
  al., "Fairness in Serving Large Language Models", OSDI 2024). Every token a step computes
  is charged to its request's tenant: `INPUT_TOKEN_COST` per prompt token and
  `OUTPUT_TOKEN_COST` per output token, divided by the tenant's weight
  (`EngineConfig.tenant_weights`, default 1). The waiting sequence of the tenant with the
  smallest counter is admitted first (ties: arrival order); under block pressure the running
  sequence of the tenant with the largest counter is preempted first. A tenant that comes
  back from idle starts at the smallest counter among the tenants with work (its counter is
  lifted, never lowered), so time spent idle is not saved up as credit to starve others with.
  Requests without a tenant share the tenant "".
- `affinity` (cache affinity): a waiting request whose prompt starts with more full blocks
  already in the prefix cache goes first (counted without allocating, once per step), so
  requests that share a prefix run while its blocks are still cached; ties by arrival. A
  waiting request that `EngineConfig.affinity_max_bypass` later arrivals have overtaken goes
  next regardless (the oldest such first), so a prompt nobody shares waits a bounded time.
  Preemption: the latest arrival first, as under `fcfs`. The ranking costs a cache lookup
  per waiting request and step (one hash per prompt block, up to its first miss).

A deadline ends a request late under every policy (finish_reason "deadline"); a full waiting
queue is answered by policy (`engine_ref.core.overload`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

SCHEDULING_POLICIES = ("fcfs", "priority", "edf", "fair", "affinity")
# The policies whose order of the waiting queue changes while requests wait (kept as a list
# and scanned, rather than a heap).
MOVING_ORDER_POLICIES = ("priority", "fair", "affinity")
# The cost of a computed prompt token and of an output token in a tenant's counter (the
# paper's w_p and w_q: an output token holds a step's row and the KV longer).
INPUT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0


def tenant_weights(text: str | None) -> object:
    """`EngineConfig.tenant_weights` (a JSON object, as the command line takes it) decoded;
    what is not valid JSON comes back as it is, for `check_policy` to name."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def check_policy(policy: object, tenant_weights: object) -> str | None:
    """A sentence naming what is wrong with the policy options, or None."""
    if policy not in SCHEDULING_POLICIES:
        return f"Unknown scheduling_policy {policy!r}; use {', '.join(SCHEDULING_POLICIES)}."
    if tenant_weights is None:
        return None
    if not isinstance(tenant_weights, Mapping):
        return f"tenant_weights must map tenant names to weights, got {tenant_weights!r}."
    for tenant, weight in tenant_weights.items():
        if not isinstance(tenant, str):
            return f"tenant_weights keys must be strings, got {tenant!r}."
        ok = isinstance(weight, int | float) and not isinstance(weight, bool)
        if not ok or not 0 < weight < float("inf"):  # NaN fails too
            return f"tenant weight {tenant!r} must be a positive number, got {weight!r}."
    return None


class FairShare:
    """The `fair` policy's virtual token counters, one per tenant (module doc)."""

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        self.counters: dict[str, float] = defaultdict(float)

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        cost = prompt_tokens * INPUT_TOKEN_COST + output_tokens * OUTPUT_TOKEN_COST
        self.counters[tenant] += cost / self.weights.get(tenant, 1.0)

    def arrive(self, tenant: str, active: Iterable[str]) -> None:
        """`tenant` gets a request; `active` are the tenants with queued or running work
        (before it). An idle tenant is lifted to the smallest active counter."""
        active = set(active)
        others = [self.counters[t] for t in active if t != tenant]
        if tenant not in active and others:
            self.counters[tenant] = max(self.counters[tenant], min(others))

    def key(self, request: Any) -> tuple[float, int]:
        """Order of admission (smallest first) and of preemption (largest first)."""
        return self.counters[request.tenant], request.arrival_index


def aged_priority(priority: int, credit: int, waited_steps: int, aging_steps: int) -> int:
    """The `priority` policy's effective priority (lower is better) of a request of
    `priority` that earned `credit` levels before and has now waited `waited_steps` steps:
    one level more per `aging_steps` steps (none when `aging_steps` is 0)."""
    earned = waited_steps // aging_steps if aging_steps else 0
    return priority - credit - earned


def affinity_pick(waiting: Iterable[Any], cached_blocks: Any, max_bypass: int) -> Any:
    """The `affinity` policy's next waiting sequence (None when there is none): the oldest
    one overtaken by `max_bypass` later arrivals, else the one with the most cached prefix
    blocks (`cached_blocks(seq)`), ties by arrival."""
    waiting = list(waiting)
    overdue = [s for s in waiting if s.num_bypassed >= max_bypass]
    if overdue:
        return min(overdue, key=lambda s: s.request.arrival_index)
    return min(waiting, key=lambda s: (-cached_blocks(s), s.request.arrival_index), default=None)
