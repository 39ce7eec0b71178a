"""The numeric-extremes cases: every numeric field set to each extreme value in turn.

One rule decides what passes: a field every OpenAI-compatible server uses (`max_tokens`, `n`,
`logprobs`, `temperature`, `top_p`) must reject a value it cannot use; a field a server may not
implement, or may clamp (`top_k`, `seed`, the penalties, `min_tokens`), may be ignored, so any
of its values may be accepted. NaN and Infinity are sent as the bare tokens Python's
`json.dumps` writes; they are not JSON, so rejecting the whole body is also a pass.
"""

from __future__ import annotations

import math
from typing import Any

from faults.probe_cases.case import (
    CHAT,
    DROP,
    EITHER,
    REJECT,
    Category,
    ProbeCase,
    chat_body,
    completion_body,
    encode,
)

_EXTREMES: tuple[tuple[str, Any], ...] = (
    ("0", 0),
    ("-1", -1),
    ("2**63", 2**63),
    ("2**64", 2**64),
    ("1e20", 1e20),
    ("NaN", math.nan),
    ("Infinity", math.inf),
)
_ALL = frozenset(label for label, _ in _EXTREMES)
_UNUSABLE = frozenset({"-1", "2**63", "2**64", "1e20", "NaN", "Infinity"})
_NOT_FINITE = frozenset({"-1", "NaN", "Infinity"})
# The extreme values each numeric field must reject; the others may be accepted or rejected.
MUST_REJECT: dict[str, frozenset[str]] = {
    "max_tokens": _UNUSABLE,
    "temperature": _NOT_FINITE,  # a huge finite temperature samples uniformly: usable
    "top_p": _UNUSABLE,
    "n": _ALL,
    "logprobs": _UNUSABLE,
    "top_k": frozenset(),
    "seed": frozenset(),
    "presence_penalty": frozenset(),
    "frequency_penalty": frozenset(),
    "min_tokens": frozenset(),
}
CHAT_MUST_REJECT: dict[str, frozenset[str]] = {
    "max_completion_tokens": _UNUSABLE,
    "top_logprobs": _UNUSABLE,
}


def numeric_extremes(model: str) -> list[ProbeCase]:
    cat = Category.NUMERIC_EXTREMES
    cases = [
        ProbeCase(
            f"{field}={label}",
            cat,
            f"{field}: {label}",
            REJECT if label in MUST_REJECT[field] else EITHER,
            encode(completion_body(model, **{field: value})),
        )
        for field in MUST_REJECT
        for label, value in _EXTREMES
    ]
    chat_fields = {
        "max_completion_tokens": {"max_tokens": DROP},
        "top_logprobs": {"logprobs": True},
    }
    cases += [
        ProbeCase(
            f"{field}={label}",
            cat,
            f"chat {field}: {label}",
            REJECT if label in CHAT_MUST_REJECT[field] else EITHER,
            encode(chat_body(model, **chat_fields[field], **{field: value})),
            path=CHAT,
        )
        for field in CHAT_MUST_REJECT
        for label, value in _EXTREMES
    ]
    for label, token in (("-1", -1), ("2**63", 2**63)):
        body = encode(completion_body(model, prompt=[token]))
        cases.append(ProbeCase(f"prompt-token-id={label}", cat, f"prompt: [{label}]", REJECT, body))
    return cases
