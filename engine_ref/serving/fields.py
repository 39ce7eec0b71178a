"""Typed reads of JSON request fields. Each reader returns None for an absent (or null) field
and raises `ApiError` 400 naming the field (`param`) when the value has the wrong type or range.
Error messages show a wrong value only briefly (`shown`), whatever its size or nesting."""

from __future__ import annotations

import math
from typing import Any

from engine_ref.serving.errors import ApiError
from engine_ref.serving.interface import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

_SHOWN_CHARS = 40


def shown(value: Any) -> str:
    """A short rendering of a JSON value for an error message: numbers, booleans and null as
    JSON writes them, a string quoted and cut at 40 characters, lists and objects by size."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        text = repr(value) if isinstance(value, float) else str(value)
        return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."
    if isinstance(value, str):
        text = value if len(value) <= _SHOWN_CHARS else value[:_SHOWN_CHARS] + "..."
        return repr(text)
    if isinstance(value, list):
        return f"a list of {len(value)} items" if value else "an empty list"
    if isinstance(value, dict):
        return f"an object with {len(value)} keys" if value else "an empty object"
    return type(value).__name__


def check_encodable(text: str, param: str) -> None:
    """ApiError 400 when `text` holds a lone surrogate (JSON allows it; UTF-8 cannot carry it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400, f"{param} contains invalid Unicode (a lone surrogate).", param=param
        ) from None


def stop_strings(stop: Any) -> tuple[str, ...] | None:
    """At most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_STRING_CHARS each (the
    engine scans every one after every output token)."""
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of them.", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(
            400,
            f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed.",
            param="stop",
        )
    for s in stop:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ApiError(
                400,
                f"a stop string has {len(s)} characters; at most {MAX_STOP_STRING_CHARS} "
                "are allowed.",
                param="stop",
            )
        check_encodable(s, "stop")
    return tuple(stop)


def stop_token_ids(body: dict[str, Any]) -> tuple[int, ...] | None:
    """At most MAX_STOP_TOKEN_IDS integers (the engine checks them against its vocabulary)."""
    ids = int_list(body, "stop_token_ids")
    if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(
            400,
            f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed.",
            param="stop_token_ids",
        )
    return ids


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
        raise ApiError(400, f"{name} must be an integer, got {shown(value)}.", param=name)
    if low is not None and value < low:
        raise ApiError(400, f"{name} must be at least {low}, got {shown(value)}.", param=name)
    if high is not None and value > high:
        raise ApiError(400, f"{name} must be at most {high}, got {shown(value)}.", param=name)
    return value


def optional_number(body: dict[str, Any], name: str, *, low: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        raise ApiError(400, f"{name} must be a finite number, got {shown(value)}.", param=name)
    if low is not None and value < low:
        raise ApiError(400, f"{name} must be at least {low}, got {shown(value)}.", param=name)
    return float(value)


def optional_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {shown(value)}.", param=name)
    return value


def optional_string(body: dict[str, Any], name: str, *, max_chars: int) -> str | None:
    """A non-empty string of at most `max_chars` characters, or None."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{name} must be a non-empty string, got {shown(value)}.", param=name)
    if len(value) > max_chars:
        raise ApiError(
            400,
            f"{name} has {len(value)} characters; at most {max_chars} are allowed.",
            param=name,
        )
    check_encodable(value, name)
    return value


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False
