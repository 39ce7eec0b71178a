"""Request fields that constrain the output to a grammar, read into one `GuidedDecoding`.

OpenAI's `response_format` ({"type": "text"}, {"type": "json_object"}, or {"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}), vLLM's `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`, and vLLM's newer `structured_outputs`
object ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}). A request sets at most
one constraint; two are a 400, as is a constraint that does not compile (checked here, before
the request reaches the engine). vLLM's backend and whitespace options are accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Any

from engine_ref.serving.errors import ApiError
from engine_ref.serving.fields import check_encodable, shown
from engine_ref.serving.interface import GrammarError, GuidedDecoding, check_guided

GUIDED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
STRUCTURED_OUTPUTS = "structured_outputs"
_STRUCTURED_KINDS = {
    "json": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
# vLLM options that tune its own backends; they change nothing here.
_IGNORED_OPTIONS = frozenset(
    {
        "backend",
        "disable_fallback",
        "disable_any_whitespace",
        "disable_additional_properties",
        "whitespace_pattern",
        "structural_tag",
    }
)


def guided_decoding(body: dict[str, Any]) -> GuidedDecoding | None:
    """The request's constraint, or None; ApiError 400 naming the field otherwise."""
    found: list[tuple[str, GuidedDecoding]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        guided = _response_format(response_format)
        if guided is not None:
            found.append(("response_format", guided))
    if body.get("guided_json") is not None:
        found.append(("guided_json", _schema(body["guided_json"], "guided_json")))
    if body.get("guided_regex") is not None:
        found.append(("guided_regex", _text("regex", body["guided_regex"], "guided_regex")))
    if body.get("guided_choice") is not None:
        found.append(("guided_choice", _choice(body["guided_choice"], "guided_choice")))
    if body.get("guided_grammar") is not None:
        found.append(("guided_grammar", _text("grammar", body["guided_grammar"], "guided_grammar")))
    if body.get(STRUCTURED_OUTPUTS) is not None:
        found += _structured_outputs(body[STRUCTURED_OUTPUTS])
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ApiError(
            400,
            f"A request may set one output constraint, but this one sets {len(found)} ({names}).",
            param=found[1][0],
        )
    param, guided = found[0]
    try:
        check_guided(guided)
    except GrammarError as exc:
        raise ApiError(400, str(exc), param=param) from None
    return guided


def _response_format(value: Any) -> GuidedDecoding | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ApiError(400, "response_format must be an object with a type.", param=param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object")
    if kind != "json_schema":
        raise ApiError(
            400,
            f"response_format.type must be text, json_object or json_schema, got {shown(kind)}.",
            param=param,
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(
            400, "response_format.json_schema must be an object with a schema.", param=param
        )
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "response_format.json_schema.name must be a string.", param=param)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(
            400, "response_format.json_schema.strict must be true or false.", param=param
        )
    if spec.get("schema") is None:
        return GuidedDecoding("json_object")  # a json_schema without a schema: any object
    return _schema(spec["schema"], param)


def _schema(value: Any, param: str) -> GuidedDecoding:
    """A JSON schema given as an object (or bool), or as its JSON text."""
    if isinstance(value, str):
        check_encodable(value, param)
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise ApiError(400, f"{param} is not valid JSON.", param=param) from None
    if not isinstance(value, dict | bool):
        raise ApiError(
            400, f"{param} must be a JSON schema (an object), got {shown(value)}.", param=param
        )
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):
        raise ApiError(400, f"{param} is nested too deeply.", param=param) from None
    return _guided(param, "json", text)


def _text(kind: str, value: Any, param: str) -> GuidedDecoding:
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param} must be a non-empty string, got {shown(value)}.", param=param)
    check_encodable(value, param)
    return _guided(param, kind, value)


def _choice(value: Any, param: str) -> GuidedDecoding:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise ApiError(400, f"{param} must be a non-empty list of strings.", param=param)
    for choice in value:
        check_encodable(choice, param)
    return _guided(param, "choice", choices=tuple(value))


def _guided(param: str, kind: str, spec: str = "", choices: tuple[str, ...] = ()) -> GuidedDecoding:
    try:
        return GuidedDecoding(kind, spec, choices)
    except GrammarError as exc:
        raise ApiError(400, str(exc), param=param) from None


def _structured_outputs(value: Any) -> list[tuple[str, GuidedDecoding]]:
    param = STRUCTURED_OUTPUTS
    if not isinstance(value, dict):
        raise ApiError(400, f"{param} must be an object.", param=param)
    found = []
    for key, item in value.items():
        if key in _IGNORED_OPTIONS or item is None:
            continue
        kind = _STRUCTURED_KINDS.get(key)
        if kind is None:
            known = ", ".join(sorted(_STRUCTURED_KINDS))
            raise ApiError(
                400, f"{param} has an unknown key {shown(key)}; use one of {known}.", param=param
            )
        name = f"{param}.{key}"
        if kind == "json":
            found.append((name, _schema(item, name)))
        elif kind == "choice":
            found.append((name, _choice(item, name)))
        elif kind == "json_object":
            if item is not True:
                raise ApiError(400, f"{name} must be true.", param=param)
            found.append((name, GuidedDecoding("json_object")))
        else:
            found.append((name, _text(kind, item, name)))
    return found
