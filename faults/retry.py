"""The client's retry policy: which answers are retried, how many times, and how long to wait."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where
from faults.plan_checks import at

_STATUSES = "a list of HTTP error codes such as [429, 503]"


def _default_statuses() -> tuple[int, ...]:
    return (429, 503)


@dataclass(frozen=True)
class RetryPolicy:
    """Client retries of answers whose HTTP status is in `statuses`; off unless `enabled`.

    The wait before retry n (1-based) is the answer's Retry-After when `honour_retry_after` and
    the header is present, else `backoff_ms * 2**(n-1)`; either is capped at `max_backoff_ms`.
    """

    enabled: bool = False
    max_attempts: int = 3
    honour_retry_after: bool = True
    statuses: tuple[int, ...] = field(default_factory=_default_statuses)
    backoff_ms: float = 100.0
    max_backoff_ms: float = 10_000.0

    def __post_init__(self) -> None:
        for key in ("enabled", "honour_retry_after"):
            ys.boolean(getattr(self, key), at(key))
        ys.number(self.max_attempts, at("max_attempts"), minimum=1, integer=True)
        statuses = ys.sequence(self.statuses, at("statuses"), what=_STATUSES)
        for i, status in enumerate(statuses):
            ys.number(
                status,
                at("statuses") / i,
                minimum=400,
                maximum=599,
                integer=True,
                what="an HTTP error code",
            )
        object.__setattr__(self, "statuses", tuple(statuses))
        for key in ("backoff_ms", "max_backoff_ms"):
            object.__setattr__(self, key, float(ys.number(getattr(self, key), at(key), above=0)))
        if self.max_backoff_ms < self.backoff_ms:
            at("max_backoff_ms").fail(
                f"got {self.max_backoff_ms:g}, below backoff_ms {self.backoff_ms:g}",
                "expected a number >= backoff_ms",
            )

    def wait_s(self, retry: int, retry_after_s: float | None) -> float:
        """Seconds to wait before retry number `retry` (1 = the first retry)."""
        cap_s = self.max_backoff_ms / 1e3
        if self.honour_retry_after and retry_after_s is not None:
            return min(max(retry_after_s, 0.0), cap_s)
        return min(self.backoff_ms / 1e3 * 2 ** (retry - 1), cap_s)

    @classmethod
    def from_dict(cls, data, where: Where | str = "retry") -> RetryPolicy:
        """A policy from its mapping as written in a plan; every error, the policy's own checks
        included, is placed at `where` (with lines when it is a place in a loaded document)."""
        return ys.from_mapping(cls, data, at(where), tuple(cls.__dataclass_fields__))

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {
            "statuses": list(self.statuses)
        }
