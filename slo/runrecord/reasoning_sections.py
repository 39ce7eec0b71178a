"""The `reasoning` block of `summary.json`: reasoning models' two first tokens, two TPOTs and
two token counts, and which TTFT the run's SLO judged.

Written by `slo.reasoning.reasoning_summary` (the definitions are in that module's docstring);
absent (None) for a run in which no request had a reasoning token. Times in ms, counts in
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from slo.runrecord.section import Section, nested
from slo.runrecord.sections import Distribution


@dataclass(frozen=True)
class Reasoning(Section):
    """`reasoning` (`slo.reasoning`): over ok requests, `requests_with_reasoning` of them had a
    reasoning token; distributions of TTFT to the first reasoning and to the first answer token,
    TPOT of each part, reasoning and answer tokens and the server's reasoning count; `slo_ttft`
    `first_token` or `first_answer_token` (None: no SLO); `definitions` in words."""

    requests_with_reasoning: int | None = None
    ttft_reasoning_ms: Distribution | None = nested(Distribution)
    ttft_answer_ms: Distribution | None = nested(Distribution)
    tpot_reasoning_ms: Distribution | None = nested(Distribution)
    tpot_answer_ms: Distribution | None = nested(Distribution)
    reasoning_tokens_per_request: Distribution | None = nested(Distribution)
    answer_tokens_per_request: Distribution | None = nested(Distribution)
    server_reasoning_tokens_per_request: Distribution | None = nested(Distribution)
    slo_ttft: str | None = None
    definitions: dict | None = None
