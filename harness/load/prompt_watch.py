"""The live side of the prompt-token cross-check: as rows are recorded (every flush), compare
the server's `usage.prompt_tokens` with the workload's `input_tokens` and warn once, in one
sentence, as soon as they disagree (from the first few requests on)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from slo.prompt_tokens import prompt_token_check
from slo.runrecord import PromptTokens, RequestRecord

MIN_REQUESTS = 3  # judge once this many requests have both counts


class PromptTokenWatch:
    """Feed it recorded rows (`observe`); it calls `warn(sentence)` once on a disagreement."""

    def __init__(self, overhead_tokens: float, warn: Callable[[str], None]) -> None:
        self.overhead_tokens = overhead_tokens
        self.warn = warn
        self.inputs: list[float] = []
        self.usage: list[float] = []
        self.warned = False

    def observe(self, records: list[RequestRecord]) -> None:
        for r in records:
            if r.turn_index:  # a later turn of a session: its prompt carries the history
                continue
            if r.input_tokens is not None and r.usage_prompt_tokens is not None:
                self.inputs.append(r.input_tokens)
                self.usage.append(r.usage_prompt_tokens)
        if self.warned or len(self.inputs) < MIN_REQUESTS:
            return
        check = PromptTokens.from_dict(
            prompt_token_check(
                np.array(self.inputs), np.array(self.usage), overhead_tokens=self.overhead_tokens
            )
        )
        if check.sentence:
            self.warned = True
            self.warn(check.sentence)
