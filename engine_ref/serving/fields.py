"""Typed reads of JSON request fields. Each reader returns None for an absent (or null) field
and raises `ApiError` 400 naming the field (`param`) when the value has the wrong type or range."""

from __future__ import annotations

import json
import math
from typing import Any

from engine_ref.serving.errors import ApiError


def check_encodable(text: str, param: str) -> None:
    """ApiError 400 when `text` holds a lone surrogate (JSON allows it; UTF-8 cannot carry it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, f"{param} contains invalid Unicode (a lone surrogate).", param=param
        ) from None


def stop_strings(stop: Any) -> tuple[str, ...] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of them.", param="stop")
    for s in stop:
        check_encodable(s, "stop")
    return tuple(stop)


def int_list(body: dict[str, Any], name: str) -> tuple[int, ...] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ApiError(400, f"{name} must be a list of integers.", param=name)
    return tuple(value)


def optional_int(
    body: dict[str, Any], name: str, *, low: int | None = None, high: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {json.dumps(value)}.", param=name)
    if low is not None and value < low:
        raise ApiError(400, f"{name} must be at least {low}, got {value}.", param=name)
    if high is not None and value > high:
        raise ApiError(400, f"{name} must be at most {high}, got {value}.", param=name)
    return value


def optional_number(body: dict[str, Any], name: str, *, low: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a finite number, got {json.dumps(value)}.", param=name)
    if low is not None and value < low:
        raise ApiError(400, f"{name} must be at least {low}, got {value}.", param=name)
    return float(value)


def optional_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {json.dumps(value)}.", param=name)
    return value
