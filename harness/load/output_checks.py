"""Per-request output checks, applied when a finished request is turned into its row: the
reference-engine comparison (exact match, first diverging token, agreement), the MLPerf
TEST06-style flags (`ignore_eos` outputs cut short, usage that disagrees with what streamed)
and the workload's output constraint (a JSON schema, regex or choice the output must hold to;
an output cut short by max_tokens fails it too), and the function calls of a request that
offered tools (`harness.load.tool_checks`).

Both outputs are compared as token ids of their text re-encoded by the run's tokenizer, so the
comparison does not depend on how either side chunked or detokenised its stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.load.tool_checks import tool_call_problem
from slo.correctness import WRONG_FLAGS, compare_tokens
from slo.runrecord import OutputFlag
from workloads.constraint import is_checkable, violation
from workloads.tools import ToolOffer

DEFAULT_DIVERGE_BEFORE = 32  # a greedy output differing within its first 32 tokens is wrong
USAGE_TOLERANCE_TOKENS = 2
USAGE_TOLERANCE = 0.1


@dataclass(frozen=True, slots=True)
class Expectation:
    """What a request asked for; `constraint` is the workload's output constraint (see
    `workloads.constraint`) and `tools` the functions it offered (`workloads.tools`), None
    without one."""

    max_tokens: int
    ignore_eos: bool
    constraint: dict | None = None
    tools: ToolOffer | None = None


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The row fields the checks fill (see `slo.runrecord.RequestColumn`)."""

    valid: bool | None = None
    exact: bool | None = None
    first_divergence: int | None = None
    agreement: float | None = None
    flags: str | None = None


class OutputChecks:
    """Checks for one run. `references` maps request ids to the reference engine's output
    text (greedy requests only); `diverge_before` is the position before which a divergence
    makes the output wrong (0: divergences are recorded, never judged wrong)."""

    def __init__(
        self,
        tokenizer,
        expectations: dict[str, Expectation],
        references: dict[str, str] | None = None,
        *,
        diverge_before: int = DEFAULT_DIVERGE_BEFORE,
    ) -> None:
        self.tokenizer = tokenizer
        self.expectations = expectations
        self.references = {rid: tokenizer.encode(text) for rid, text in (references or {}).items()}
        self.diverge_before = diverge_before

    def check(
        self,
        request_id: str,
        text: str,
        *,
        output_tokens: int | None,
        usage_completion_tokens: int | None,
        token_chunks: int,
        streamed: bool,
        client_tokens: int | None = None,
        tool_calls: list | None = None,
    ) -> CheckResult:
        """The checks of one ok request's output; `tool_calls` are the answer's function
        calls (`harness.http.tool_calls.ToolCall`; None: it made none)."""
        flags: list[OutputFlag] = []
        expected = self.expectations.get(request_id)
        if expected is not None and expected.ignore_eos and output_tokens is not None:
            if output_tokens < expected.max_tokens:
                flags.append(OutputFlag.SHORT_IGNORE_EOS)
        if usage_completion_tokens is not None and text:
            slack = max(USAGE_TOLERANCE_TOKENS, USAGE_TOLERANCE * usage_completion_tokens)
            # Fewer tokens than token-bearing events is impossible. Otherwise both counts of the
            # client must disagree: retokenising text is not always a round trip, and servers
            # may merge tokens into one event, but not both by much at once.
            # The streamed counts: one per token-bearing event, and (`client_tokens`) what the
            # chunks' own counts add up to, several per event under speculative decoding. A
            # mismatch needs every count of the client to disagree.
            streamed_counts = [token_chunks] + (
                [client_tokens] if client_tokens is not None else []
            )
            too_few = streamed and usage_completion_tokens < token_chunks
            off_events = not streamed or all(
                abs(count - usage_completion_tokens) > slack for count in streamed_counts
            )
            # The text is retokenised only when the streamed counts already disagree: it is
            # the costly count (a whole output), and alone it flags nothing.
            if too_few or (
                off_events
                and abs(len(self.tokenizer.encode(text)) - usage_completion_tokens) > slack
            ):
                flags.append(OutputFlag.USAGE_MISMATCH)
        constrained = expected is not None and expected.constraint is not None
        constraint_ok = None
        if constrained and is_checkable(expected.constraint):
            constraint_ok = violation(expected.constraint, text) is None
            if not constraint_ok:
                flags.append(OutputFlag.CONSTRAINT_VIOLATED)
        tools_ok = None
        if expected is not None and expected.tools is not None:
            tools_ok = tool_call_problem(expected.tools, tool_calls) is None
            if not tools_ok:
                flags.append(OutputFlag.TOOL_CALL_INVALID)
        exact = first = agreement = None
        reference = self.references.get(request_id)
        if reference is not None:
            exact, first, agreement = compare_tokens(reference, self.tokenizer.encode(text))
            if first == 0:
                flags.append(OutputFlag.FIRST_TOKEN_DIFFERS)
            if first is not None and first < self.diverge_before:
                flags.append(OutputFlag.DIVERGED)
        wrong = bool(set(flags) & WRONG_FLAGS)
        checked = reference is not None or constraint_ok is not None or tools_ok is not None
        valid = False if wrong else (True if checked else None)
        return CheckResult(
            valid=valid,
            exact=exact,
            first_divergence=first,
            agreement=agreement,
            flags=",".join(f.value for f in flags) or None,
        )

    def offers_tools(self, request_id: str) -> bool:
        """Whether the request offered tools."""
        expected = self.expectations.get(request_id)
        return expected is not None and expected.tools is not None
