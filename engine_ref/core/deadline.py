"""Whether a request can finish by its deadline: the `edf` policy's admission estimate.

A request with a deadline is admitted under `edf` only when

    now + (tokens ahead + its prompt) / prefill rate + max_tokens x decode step time <= deadline

where "tokens ahead" are the positions still to prefill of the waiting requests that go before
it (deadline no later than its own; a preempted one recomputes its outputs too), and the rates
are the engine's own measurements (`engine_ref.core.step_meter`). The estimate is deliberately
simple: it ignores the prefix cache (which can only make a prefill shorter), the running
requests' remaining decode steps (decode steps are shared by the whole batch, so they mostly
overlap its own) and a stop before max_tokens. A rate not yet measured counts as free, so an
engine that has not run a step yet admits everything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine_ref.core.step_meter import StepRates


@dataclass(frozen=True)
class DeadlineEstimate:
    """How long a request would take from now, in seconds: `ahead_s` prefilling the work
    queued before it, `prefill_s` its own prompt, `decode_s` its max_tokens decode steps."""

    ahead_s: float
    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
        return self.ahead_s + self.prefill_s + self.decode_s

    def retry_after_s(self) -> int:
        """Whole seconds after which the work ahead should be done (at least 1): when to
        ask again."""
        return max(1, math.ceil(self.ahead_s))


def estimate(
    rates: StepRates, *, tokens_ahead: int, prompt_tokens: int, max_tokens: int
) -> DeadlineEstimate:
    """The module doc's estimate for a request of `prompt_tokens` positions to prefill and
    `max_tokens` to generate behind `tokens_ahead` positions of others."""
    return DeadlineEstimate(
        ahead_s=rates.prefill_s(tokens_ahead),
        prefill_s=rates.prefill_s(prompt_tokens),
        decode_s=rates.decode_s(max_tokens),
    )


def infeasible_reason(
    estimate: DeadlineEstimate, *, budget_s: float, deadline_ms: float
) -> str | None:
    """One sentence saying why a request with `budget_s` seconds left before its deadline
    (`deadline_ms` as it was asked) cannot make it, or None when it can."""
    if estimate.total_s <= budget_s:
        return None
    alone = estimate.prefill_s + estimate.decode_s
    why = (
        "even with nothing queued ahead of it"
        if alone > budget_s
        else f"{estimate.ahead_s * 1e3:.0f} ms of it prefilling the requests queued ahead"
    )
    return (
        f"The deadline of {deadline_ms:g} ms cannot be met: this engine estimates "
        f"{estimate.total_s * 1e3:.0f} ms at its measured speed ({why}); allow more time, "
        "ask for fewer tokens, or retry later."
    )
