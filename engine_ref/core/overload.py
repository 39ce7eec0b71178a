"""Overload, answered explicitly: the waiting queue is bounded under every policy
(`EngineConfig.max_waiting_requests`), what happens when it is full follows the policy, a
request the `edf` policy cannot serve in time is refused at once, and a request whose deadline
passes is ended. Every refusal and every request ended early is counted by reason
(`SHED_REASONS`, in `EngineStats.requests_shed_by_reason`); nothing else is kept of a refused
request, so memory does not grow with refusals.

When the queue is full, a newcomer is refused (`QueueFullError`, reason `queue_full`) unless
the policy finds a waiting request to shed in its favour; a shed request ends with
finish_reason "shed", keeping whatever it had streamed (a request is shed whole, all its
samples):
- `fcfs`, `affinity`: never; the newcomer is refused.
- `priority`: the worst waiting request (largest aged priority, then latest arrival) is shed
  when the newcomer's priority is strictly better (reason `displaced`).
- `edf`: the first waiting request, in deadline order, that its own estimate says can no
  longer make its deadline (`engine_ref.core.deadline`, with the work queued before it) is
  shed (reason `infeasible_shed`); when every waiting request can still make it, the
  newcomer is refused.
- `fair`: the latest waiting request of the tenant with the largest counter is shed when that
  tenant is not the newcomer's and its counter is strictly larger (reason `displaced`), so a
  tenant that has had more than its share cannot hold the queue against a lighter one.

Under `edf` a newcomer with a deadline it cannot meet is refused before the queue bound is
looked at (`DeadlineInfeasibleError`, reason `deadline_infeasible`). Under every policy a
request with a deadline that is still waiting or running when its deadline passes ends at the
start of the next step with finish_reason "deadline" (reason `deadline_missed`), keeping what
it generated.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from engine_ref.core.deadline import estimate, infeasible_reason
from engine_ref.core.policy import FairShare

if TYPE_CHECKING:
    from engine_ref.core.engine_config import EngineConfig
    from engine_ref.core.outputs import RequestOutput
    from engine_ref.core.sequence import Request, Sequence
    from engine_ref.core.step_meter import StepMeter

SHED_REASONS = (
    "queue_full",
    "deadline_infeasible",
    "displaced",
    "infeasible_shed",
    "deadline_missed",
)


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting_requests`; the request was refused.
    `retry_after_s`: when to ask again, if the engine can tell (None: it cannot)."""

    reason = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineInfeasibleError(QueueFullError):
    """Under `edf`, the request's deadline cannot be met by the engine's estimate; the message
    says why, `retry_after_s` when the work queued ahead of it should be done."""

    reason = "deadline_infeasible"


class WaitingQueue(Protocol):
    """What overload control uses of the scheduler (which imports this module's errors)."""

    fair: FairShare | None

    @property
    def num_waiting(self) -> int: ...

    def waiting(self) -> Iterator[Sequence]: ...

    def key(self, seq: Sequence) -> tuple[float, int]: ...

    def add(self, seq: Sequence) -> None: ...


class OverloadControl:
    """Admits sequences to `scheduler` under the module doc's rules. `finish(request, reason)`
    ends a request (the output processor's); `requests` is the engine's table of unfinished
    requests, from which ended ones are removed; `meter` gives the clock and the rates."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: WaitingQueue,
        finish: Callable[[Request, str], RequestOutput],
        meter: StepMeter,
        requests: dict[str, Request],
    ) -> None:
        self.policy = config.scheduling_policy
        self.max_waiting = config.max_waiting_requests
        self.scheduler = scheduler
        self.finish = finish
        self.meter = meter
        self.requests = requests
        self.counts = dict.fromkeys(SHED_REASONS, 0)
        self._deadlines: list[tuple[float, int, Request]] = []  # heap, by deadline

    def admit(self, seq: Sequence, deadline_ms: int | None) -> list[RequestOutput]:
        """Queue `seq` (its request's first sequence), its deadline `deadline_ms` from now
        (None: none); returns the final outputs of the requests shed to make room. Raises
        DeadlineInfeasibleError or QueueFullError, leaving nothing queued."""
        request = seq.request
        now = self.meter.clock()
        if deadline_ms is not None:
            request.deadline_s = now + deadline_ms / 1e3
            if self.policy == "edf":
                self._check_feasible(seq, now, deadline_ms)
        shed = []
        if self.scheduler.num_waiting >= self.max_waiting:
            victim, reason = self._victim(seq, now)
            if victim is None:
                self.counts["queue_full"] += 1
                raise QueueFullError(
                    f"Waiting queue is full ({self.max_waiting} requests); retry later."
                )
            shed.append(self._end(victim.request, "shed", reason))
        self.scheduler.add(seq)
        if request.deadline_s is not None:
            self._compact()  # before the push: the engine lists `request` only once it returns
            heapq.heappush(self._deadlines, (request.deadline_s, request.arrival_index, request))
        return shed

    def expire(self) -> list[RequestOutput]:
        """End the requests whose deadline has passed (finish_reason "deadline")."""
        now = self.meter.clock()
        outputs = []
        while self._deadlines and self._deadlines[0][0] < now:
            request = heapq.heappop(self._deadlines)[2]
            if self.requests.get(request.request_id) is request:
                outputs.append(self._end(request, "deadline", "deadline_missed"))
        self._compact()
        return outputs

    def _compact(self) -> None:
        """Drop the deadlines of requests that ended otherwise, once they are the majority, so
        the heap's memory follows the requests in the engine."""
        if len(self._deadlines) > 2 * len(self.requests) + 64:
            live = [e for e in self._deadlines if self.requests.get(e[2].request_id) is e[2]]
            heapq.heapify(live)
            self._deadlines = live

    def _end(self, request: Request, finish_reason: str, count_as: str) -> RequestOutput:
        self.counts[count_as] += 1
        self.requests.pop(request.request_id, None)
        return self.finish(request, finish_reason)

    def _check_feasible(self, seq: Sequence, now: float, deadline_ms: int) -> None:
        request = seq.request
        deadline_s = request.deadline_s
        assert deadline_s is not None
        ahead = sum(
            s.num_uncomputed_tokens
            for s in self.scheduler.waiting()
            if s.request.deadline_s is not None and s.request.deadline_s <= deadline_s
        )
        guess = estimate(
            self.meter.rates,
            tokens_ahead=ahead,
            prompt_tokens=seq.num_tokens,
            max_tokens=request.params.max_tokens,
        )
        reason = infeasible_reason(guess, budget_s=deadline_s - now, deadline_ms=deadline_ms)
        if reason is not None:
            self.counts["deadline_infeasible"] += 1
            raise DeadlineInfeasibleError(reason, retry_after_s=guess.retry_after_s())

    def _victim(self, seq: Sequence, now: float) -> tuple[Sequence | None, str]:
        """The waiting sequence to shed for `seq` under the policy, and the reason."""
        waiting = list(self.scheduler.waiting())
        if not waiting:
            return None, ""
        key = self.scheduler.key
        if self.policy == "priority":
            worst = max(waiting, key=key)
            if seq.request.priority < key(worst)[0]:
                return worst, "displaced"
        elif self.policy == "edf":
            ahead = 0
            for s in sorted(waiting, key=key):
                deadline_s = s.request.deadline_s
                left = max(0, s.request.params.max_tokens - s.num_output_tokens)
                guess = estimate(
                    self.meter.rates,
                    tokens_ahead=ahead,
                    prompt_tokens=s.num_uncomputed_tokens,
                    max_tokens=left,
                )
                if deadline_s is not None and now + guess.total_s > deadline_s:
                    return s, "infeasible_shed"
                ahead += s.num_uncomputed_tokens
        elif self.policy == "fair":
            fair = self.scheduler.fair
            assert fair is not None
            counter = fair.counters.get
            heaviest = max(waiting, key=lambda s: (counter(s.request.tenant, 0.0), key(s)[1]))
            tenant = heaviest.request.tenant
            if tenant != seq.request.tenant and (
                counter(tenant, 0.0) > counter(seq.request.tenant, 0.0)
            ):
                return heaviest, "displaced"
        return None, ""
