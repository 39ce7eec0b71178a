"""The checks every part of a fault plan shares when it is read from YAML, and the error they
raise: one sentence naming the fix."""

from __future__ import annotations

import math
from enum import StrEnum


class FaultPlanError(Exception):
    """A bad fault plan or an unknown built-in name; the message is one sentence naming the fix."""


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def as_mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise FaultPlanError(f"{where} must be a mapping, not {type(value).__name__}.")
    return value


def check_keys(data: dict, known: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        known_text = ", ".join(known) if known else "none"
        raise FaultPlanError(
            f"{where} has unknown field {unknown[0]!r}; known fields: {known_text}."
        )


def member(enum: type[StrEnum], value, where: str):
    try:
        return enum(value)
    except (ValueError, TypeError):
        known = ", ".join(m.value for m in enum)
        raise FaultPlanError(f"{where} {value!r} is unknown; known: {known}.") from None
