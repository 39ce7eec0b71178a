"""The error a fault plan's checks raise and the place they report at: every part of a plan
(`faults.plan`, `faults.window`, `faults.retry`) checks with `bench_common.yaml_spec`, so each
problem is one sentence of its form, naming the key, its line and what is accepted."""

from __future__ import annotations

import math

from bench_common import yaml_spec as ys
from bench_common.yaml_spec import Where


class FaultPlanError(Exception):
    """A bad fault plan or an unknown built-in name; the message is one sentence naming the fix."""


def at(where: Where | str) -> Where:
    """`where` as a place whose checks raise `FaultPlanError` (a string is a bare key path)."""
    return ys.as_where(where, FaultPlanError)


def is_number(value) -> bool:
    """Whether `value` is a finite int or float (not a boolean)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
