"""Which requests a client fault affects: those a wrapper's `active` gate admits (None: all;
`RunClock.gate` turns a plan window into one, judged when the request is sent) and, of those, a
`fraction` picked by hashing (seed, request id), so a rerun picks the same requests. Warm-up
requests are never affected."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from faults.plan import FaultPlan
from faults.window import WindowTracker
from harness.http.client import RequestPayload

Gate = Callable[[RequestPayload], bool]


def picked(seed: int | str, request_id: str, fraction: float) -> bool:
    """Whether `request_id` falls in the `fraction` that `seed` picks (stable across runs)."""
    if fraction >= 1:
        return True
    digest = hashlib.sha256(f"{seed}\0{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def affected(
    payload: RequestPayload, active: Gate | None, seed: int | str, fraction: float
) -> bool:
    """Whether a wrapper with gate `active` (None: always open) faults this request: never a
    warm-up one, else those the gate admits and, of those, the `fraction` that `seed` picks."""
    if payload.is_warmup or (active is not None and not active(payload)):
        return False
    return picked(seed, payload.request_id, fraction)


class RunClock:
    """Where the measured phase is, for the client-fault gates: seconds since `start` (pass it
    as `run_load`'s `start_callback`) and how many requests were sent before each one."""

    def __init__(self, plan: FaultPlan, *, clock: Callable[[], int] = time.perf_counter_ns):
        self.plan = plan
        self.clock = clock
        self.t0_ns: int | None = None
        self.tracker = WindowTracker(plan)
        self._ordinal: dict[str, int] = {}

    def start(self, t0_ns: int) -> None:
        self.t0_ns = t0_ns

    @property
    def requests_sent(self) -> int:
        return len(self._ordinal)

    def elapsed_s(self) -> float | None:
        return None if self.t0_ns is None else (self.clock() - self.t0_ns) / 1e9

    def note_sent(self, payload: RequestPayload) -> int | None:
        """The number of measured requests sent before this one (the same on every call for
        one request id); None for warm-up requests and before `start`."""
        if payload.is_warmup or self.t0_ns is None:
            return None
        return self._ordinal.setdefault(payload.request_id, len(self._ordinal))

    def gate(self, index: int) -> Gate:
        """A gate admitting the requests sent while `plan.windows[index]` is active."""
        window = self.plan.windows[index]

        def active(payload: RequestPayload) -> bool:
            before = self.note_sent(payload)
            if before is None:
                return False
            elapsed_s = self.elapsed_s()
            self.tracker.update(elapsed_s, before)
            return window.is_active(elapsed_s, before, self.tracker.trigger_s.get(index))

        return active
