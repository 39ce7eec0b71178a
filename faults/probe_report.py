"""What `bench probe bad-input` found: a frozen result per case, the background streams' tally,
and the whole report, as data (JSON here; the console table is `probe_cli.render_report`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from faults.probe_cases.case import Category


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    NOT_SERVED = "not-served"  # the server does not serve the case's route: neither


class HealthAfter(StrEnum):
    """The server's state after a case: well, answering but unhealthy, giving another answer
    to the reference request, not answering at all, or not checked (the case did not run)."""

    OK = "ok"
    UNHEALTHY = "unhealthy"
    WRONG_ANSWER = "wrong-answer"
    DOWN = "down"
    NOT_CHECKED = "not-checked"


@dataclass(frozen=True)
class CaseResult:
    name: str
    category: Category
    request: str
    status: int | None
    body_excerpt: str
    verdict: Verdict
    reason: str
    health_after: HealthAfter
    latency_ms: float | None


@dataclass(frozen=True)
class StreamFailure:
    """A background stream that did not end with the reference text, and the cases that ran
    while it was in flight."""

    reason: str
    during: tuple[str, ...]


@dataclass(frozen=True)
class StreamsResult:
    num_streams: int
    num_completed: int
    num_failed: int
    failures: tuple[StreamFailure, ...]  # the first few
    max_latency_ms: float | None

    @property
    def passed(self) -> bool:
        return self.num_failed == 0


@dataclass(frozen=True)
class ProbeReport:
    url: str
    model: str
    health_path: str
    reference_text: str
    results: tuple[CaseResult, ...]
    streams: StreamsResult

    @property
    def failed(self) -> tuple[CaseResult, ...]:
        return tuple(r for r in self.results if r.verdict is Verdict.FAIL)

    @property
    def not_served(self) -> tuple[CaseResult, ...]:
        return tuple(r for r in self.results if r.verdict is Verdict.NOT_SERVED)

    @property
    def passed(self) -> bool:
        return not self.failed and self.streams.passed

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "health_path": self.health_path,
            "reference_text": self.reference_text,
            "passed": self.passed,
            "num_cases": len(self.results),
            "num_failed": len(self.failed),
            "num_not_served": len(self.not_served),
            "cases": [asdict(r) for r in self.results],
            "streams": {**asdict(self.streams), "passed": self.streams.passed},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)
