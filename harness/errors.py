"""Errors a user can cause; the CLI prints their one-sentence message and exits with code 2."""

from __future__ import annotations

import math


class HarnessError(Exception):
    """A problem with the user's input or environment, described in one sentence."""


def check_positive(name: str, value, *, integer: bool = False) -> None:
    """Refuse, in one sentence naming the flag `--name` (underscores as dashes), a `value` that
    is not above zero (NaN included), or with `integer` not a whole number; None passes."""
    if value is None:
        return
    flag = f"--{name.replace('_', '-')}"
    if integer and (isinstance(value, bool) or int(value) != value):
        raise HarnessError(f"{flag} must be a whole number, got {value!r}.")
    if not value > 0 or (isinstance(value, float) and math.isnan(value)):
        raise HarnessError(f"{flag} must be greater than zero, got {value!r}.")
