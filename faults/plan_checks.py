"""The checks every part of a fault plan shares when it is read from YAML, and the error they
raise: one sentence naming the fix, in the form of `bench_common.yaml_spec`."""

from __future__ import annotations

import math
from enum import StrEnum

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where


class FaultPlanError(Exception):
    """A bad fault plan or an unknown built-in name; the message is one sentence naming the fix."""


def at(where: Where | str) -> Where:
    """`where` as a place whose checks raise `FaultPlanError` (a string is a bare key path)."""
    return ys.as_where(where, FaultPlanError)


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def as_mapping(value, where: Where | str) -> dict:
    return ys.mapping(value, at(where))


def check_keys(data: dict, known: tuple[str, ...], where: Where | str) -> None:
    ys.keys(data, at(where), known)


def member(enum: type[StrEnum], value, where: Where | str):
    return ys.enum_member(value, at(where), enum)
