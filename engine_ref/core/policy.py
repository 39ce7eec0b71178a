"""Scheduling policies: which waiting sequence the scheduler admits next, which running one it
preempts first when blocks run out, and the per-tenant accounts the `fair` policy keeps.

- `fcfs`: arrival order.
- `priority`: lower `priority` first (vLLM's convention), then arrival.
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
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
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
