"""A request's reasoning columns, from its parsed stream's per-event parts.

`harness.http.reasoning` marks each event reasoning, answer or both; here they become the
request's times (first and last reasoning token, first answer token, relative to the run's
t0), its reasoning and answer token counts (the chunks' own counts, so they add up to
`client_output_tokens`, and to the usage when the server counted the chunks), the server's own
reasoning count, and the chunk rows' `reasoning` marker. A stream without reasoning gets
reasoning 0, every token answer, and its first answer token at its first token: a run can then
judge TTFT to the first answer token the same way with or without reasoning.

A non-streamed answer has no token times; its reasoning count is the server's, else its
reasoning text retokenised where the run has a tokenizer (else unknown), and the answer the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from harness.http.reasoning import Part
from harness.http.sse import ParsedStream
from slo.runrecord import RequestRecord

# plain ints: numpy compares an int8 array with an IntEnum member several times slower
_ANSWER, _REASONING = int(Part.ANSWER), int(Part.REASONING)


def usage_reasoning_tokens(usage: dict) -> int | None:
    """`usage.completion_tokens_details.reasoning_tokens` when it is a count, else None."""
    details = usage.get("completion_tokens_details")
    value = details.get("reasoning_tokens") if isinstance(details, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31:
        return value
    return None


def set_reasoning(
    record: RequestRecord,
    parsed: ParsedStream | None,
    *,
    streamed: bool,
    t0_ns: int,
    usage: dict,
    count_tokens: Callable[[str], int] | None,
) -> np.ndarray | None:
    """Fill `record`'s reasoning columns (module doc); return the chunks' `reasoning` marker
    (bool per chunk), None without a parsed answer."""
    record.usage_reasoning_tokens = usage_reasoning_tokens(usage)
    if parsed is None:
        return None
    part = parsed.part
    if not streamed:
        reasoning = record.usage_reasoning_tokens
        if reasoning is None and not parsed.reasoning_text:
            reasoning = 0
        elif reasoning is None and count_tokens is not None:
            reasoning = count_tokens(parsed.reasoning_text)
        record.output_reasoning_tokens = reasoning
        total = record.output_tokens
        if reasoning is not None and total is not None:
            record.output_answer_tokens = max(total - reasoning, 0)
        return np.zeros(len(part), bool)
    has_tokens = parsed.n_tokens > 0
    if not part.any():  # every chunk answer (Part.ANSWER is 0): the common stream
        record.output_reasoning_tokens = 0
        record.output_answer_tokens = int(parsed.n_tokens.sum())
        record.t_first_answer_token_ns = _first(parsed.t_ns, has_tokens, t0_ns)
        return np.zeros(len(part), bool)
    is_reasoning = part == _REASONING
    record.output_reasoning_tokens = int(parsed.n_tokens[is_reasoning].sum())
    record.output_answer_tokens = int(parsed.n_tokens[~is_reasoning].sum())
    record.t_first_reasoning_token_ns = _first(parsed.t_ns, has_tokens & (part != _ANSWER), t0_ns)
    record.t_first_answer_token_ns = _first(parsed.t_ns, has_tokens & ~is_reasoning, t0_ns)
    reasoning_times = parsed.t_ns[has_tokens & is_reasoning]
    if reasoning_times.size:
        record.t_last_reasoning_token_ns = int(reasoning_times[-1]) - t0_ns
    return is_reasoning


def _first(t_ns: np.ndarray, mask: np.ndarray, t0_ns: int) -> int | None:
    times = t_ns[mask]
    return int(times[0]) - t0_ns if times.size else None
