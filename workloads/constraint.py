"""A workload's output constraint: what every request asks the server to hold its output to,
how the request says it, and whether an output holds to it.

In a spec, `constraint` is a mapping with exactly one of:
  json_schema: <a JSON schema mapping>   (optional `name`, default "output")
  json_object: true                      any JSON object
  regex: <pattern>                       the whole output matches (Python `re.fullmatch`)
  choice: [<string>, ...]                the output is one of them
  grammar: <EBNF text>                   sent as is; outputs are not checked here

On the wire, JSON constraints are OpenAI's `response_format` (json_schema, strict, or
json_object), which vLLM, SGLang, llama.cpp's server and the reference engine all take;
regex, choice and grammar are vLLM's `structured_outputs` object (vLLM 0.12 removed the older
`guided_*` fields; the reference engine takes both).
"""

from __future__ import annotations

import json
import re
from typing import Any

from workloads.schema import WorkloadError

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
DEFAULT_SCHEMA_NAME = "output"


def _jsonschema() -> Any:
    try:
        import jsonschema
    except ImportError:
        raise WorkloadError(
            "A json_schema constraint needs the jsonschema package to check outputs "
            "(pip install jsonschema)."
        ) from None
    return jsonschema


def check_constraint(value: Any, origin: str) -> None:
    """Raise WorkloadError (naming `origin`) unless `value` is a valid constraint mapping."""

    def fail(message: str) -> None:
        raise WorkloadError(f"{origin}: constraint {message}")

    if not isinstance(value, dict):
        fail(f"must be a mapping with one of {', '.join(CONSTRAINT_KINDS)}.")
    kinds = [k for k in value if k in CONSTRAINT_KINDS]
    unknown = sorted(set(value) - set(CONSTRAINT_KINDS) - {"name"})
    if unknown:
        fail(f"does not take {', '.join(unknown)}; use one of {', '.join(CONSTRAINT_KINDS)}.")
    if len(kinds) != 1:
        fail(f"needs exactly one of {', '.join(CONSTRAINT_KINDS)}, got {len(kinds)}.")
    kind = kinds[0]
    item = value[kind]
    if "name" in value and (kind != "json_schema" or not isinstance(value["name"], str)):
        fail("name is a string, and applies to json_schema only.")
    if kind == "json_schema":
        if not isinstance(item, dict):
            fail("json_schema must be a mapping (a JSON schema).")
        jsonschema = _jsonschema()
        try:
            jsonschema.validators.validator_for(item).check_schema(item)
        except jsonschema.SchemaError as exc:
            fail(f"json_schema is not a valid JSON schema: {exc.message}.")
    elif kind == "json_object":
        if item is not True:
            fail("json_object must be true.")
    elif kind == "regex":
        if not isinstance(item, str) or not item:
            fail("regex must be a non-empty string.")
        try:
            re.compile(item)
        except re.error as exc:
            fail(f"regex does not compile: {exc}.")
    elif kind == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) for c in item):
            fail("choice must be a non-empty list of strings.")
    elif not isinstance(item, str) or not item:
        fail("grammar must be a non-empty string.")


def constraint_kind(constraint: dict) -> str:
    return next(k for k in constraint if k in CONSTRAINT_KINDS)


def request_fields(constraint: dict) -> dict[str, Any]:
    """The request body fields that ask for `constraint` (a checked mapping)."""
    kind = constraint_kind(constraint)
    if kind == "json_schema":
        spec = {
            "name": constraint.get("name", DEFAULT_SCHEMA_NAME),
            "schema": constraint[kind],
            "strict": True,
        }
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    return {"structured_outputs": {kind: constraint[kind]}}


def violation(constraint: dict, text: str) -> str | None:
    """Why `text` does not hold to `constraint` (one sentence), or None when it does or
    cannot be checked here (a grammar)."""
    kind = constraint_kind(constraint)
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            return f"The output is not valid JSON ({exc})."
        if kind == "json_object":
            return None if isinstance(value, dict) else "The output is JSON but not an object."
        jsonschema = _jsonschema()
        schema = constraint[kind]
        errors = jsonschema.validators.validator_for(schema)(schema).iter_errors(value)
        error = next(iter(errors), None)
        return None if error is None else f"The output does not match its schema: {error.message}."
    if kind == "regex":
        if re.fullmatch(constraint[kind], text) is None:
            return "The output does not match the regex."
        return None
    if kind == "choice":
        return None if text in constraint[kind] else "The output is not one of the choices."
    return None


def is_checkable(constraint: dict) -> bool:
    return constraint_kind(constraint) != "grammar"
