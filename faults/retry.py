"""The client's retry policy: which answers are retried, how many times, and how long to wait."""

from __future__ import annotations

from dataclasses import dataclass, field

from faults.plan_checks import FaultPlanError, as_mapping, check_keys, is_number


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
            if not isinstance(getattr(self, key), bool):
                raise FaultPlanError(f"retry.{key} must be true or false.")
        n = self.max_attempts
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise FaultPlanError(f"retry.max_attempts must be an integer >= 1, not {n!r}.")
        statuses = self.statuses
        if not isinstance(statuses, list | tuple) or not all(
            isinstance(s, int) and not isinstance(s, bool) and 400 <= s <= 599 for s in statuses
        ):
            raise FaultPlanError(
                f"retry.statuses must be HTTP error codes such as [429, 503], not {statuses!r}."
            )
        object.__setattr__(self, "statuses", tuple(statuses))
        for key in ("backoff_ms", "max_backoff_ms"):
            v = getattr(self, key)
            if not is_number(v) or v <= 0:
                raise FaultPlanError(f"retry.{key} must be a positive number, not {v!r}.")
            object.__setattr__(self, key, float(v))
        if self.max_backoff_ms < self.backoff_ms:
            raise FaultPlanError("retry.max_backoff_ms must be at least retry.backoff_ms.")

    def wait_s(self, retry: int, retry_after_s: float | None) -> float:
        """Seconds to wait before retry number `retry` (1 = the first retry)."""
        cap_s = self.max_backoff_ms / 1e3
        if self.honour_retry_after and retry_after_s is not None:
            return min(max(retry_after_s, 0.0), cap_s)
        return min(self.backoff_ms / 1e3 * 2 ** (retry - 1), cap_s)

    @classmethod
    def from_dict(cls, data, where: str = "retry") -> RetryPolicy:
        data = as_mapping(data, where)
        check_keys(data, tuple(cls.__dataclass_fields__), where)
        return cls(**data)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {
            "statuses": list(self.statuses)
        }
