"""What each step computed and how fast: the token counters of `EngineStats` (by step kind) and
the engine's own measured speed, which the `edf` policy's deadline admission estimates from.

Two rates, each an exponentially weighted moving average (EWMA) over recent steps with weight
`alpha` for the newest (0.2: about the last ten steps count):
- `prefill_tokens_per_s`: prompt positions computed per second. A step with only prompt rows
  measures it directly (its prompt positions over its duration); a mixed step does too once
  the decode step time is known, from the time left after one decode step.
- `decode_step_s`: the duration of a step with only decode rows (one token for each running
  sequence).
A step's duration runs from `start()` (before its forward) to `count()` (after its commit), on
the engine's clock; a step that took no measurable time (a frozen test clock) measures nothing.
Rates passed in are where the averages start; with `alpha` 0 they never move (tests hand-work
admission decisions with them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass
class StepRates:
    """The measured speed (module doc); None until the first step that measures it."""

    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    alpha: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}.")
        for name in ("prefill_tokens_per_s", "decode_step_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value}.")

    def observe(self, num_prompt_tokens: int, num_decode_tokens: int, duration_s: float) -> None:
        """Fold in one step that computed `num_prompt_tokens` prompt positions and
        `num_decode_tokens` other positions (decode rows, drafts) in `duration_s`."""
        if duration_s <= 0:
            return
        if not num_prompt_tokens:
            if num_decode_tokens:
                self.decode_step_s = self._average(self.decode_step_s, duration_s)
            return
        prefill_s = duration_s
        if num_decode_tokens:
            if self.decode_step_s is None:
                return
            prefill_s -= self.decode_step_s
        if prefill_s > 0:
            rate = num_prompt_tokens / prefill_s
            self.prefill_tokens_per_s = self._average(self.prefill_tokens_per_s, rate)

    def prefill_s(self, num_tokens: int) -> float:
        """Seconds to prefill `num_tokens` positions; 0 before the rate is measured."""
        rate = self.prefill_tokens_per_s
        return num_tokens / rate if rate else 0.0

    def decode_s(self, num_steps: int) -> float:
        """Seconds for `num_steps` decode steps; 0 before the step time is measured."""
        return num_steps * self.decode_step_s if self.decode_step_s else 0.0

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.alpha) * old + self.alpha * new


class StepMeter:
    """Counts each step's tokens by kind (`prefill`: only prompt rows, `decode`: only decode
    rows, `mixed`: both) and times it on `clock` (seconds) into `rates`."""

    def __init__(self, clock: Callable[[], float], rates: StepRates | None = None) -> None:
        self.clock = clock
        self.rates = rates if rates is not None else StepRates()
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.generation_tokens: dict[str, int] = defaultdict(int)
        self._started_s = 0.0

    def start(self) -> None:
        self._started_s = self.clock()

    def count(self, executed: Iterable[Any]) -> None:
        """One step's executed runs (`output_processor.Executed`), committed."""
        executed = list(executed)
        num_prompt_rows = sum(run.num_prompt_rows for run in executed)
        num_rows = sum(n for run in executed for _, n in run.items)
        kind = "mixed" if num_prompt_rows and num_prompt_rows < num_rows else None
        kind = kind or ("prefill" if num_prompt_rows else "decode")
        self.prompt_tokens[kind] += num_prompt_rows
        self.generation_tokens[kind] += sum(
            len(run.token_ids) + run.num_spec_tokens + len(run.beam_candidates) for run in executed
        )
        duration_s = self.clock() - self._started_s
        self.rates.observe(num_prompt_rows, num_rows - num_prompt_rows, duration_s)
