"""The mock server's function calls: with `--tool-calls`, a chat request that offers `tools`
is answered with one call instead of text, on the same token schedule.

Modes: `valid` calls the first offered function with the simplest arguments its schema
accepts (each required property: an enum's first value, the minimum of a number, "x", true,
{} or []); `bad_json` calls it with arguments that are not JSON; `unknown_function` calls a
function that was not offered, with `{}`. The arguments text is padded with trailing spaces
(still the same JSON) to one character per output token, so a stream sends a header delta
(index, id, type, name, first character) and then one argument fragment per token, and the
TTFT and ITL of a tool-calling stream are the mock's configured ones.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CALL_MODES = ("valid", "bad_json", "unknown_function")
UNKNOWN_FUNCTION = "not_an_offered_function"
CALL_ID = "call-mock-0"


def _simplest(schema: Any) -> Any:
    """The simplest value `schema` accepts (for the mock's bounded schemas)."""
    if not isinstance(schema, dict):
        return {}
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type", "object")
    if kind in ("integer", "number"):
        return schema.get("minimum", 0)
    if kind == "string":
        return "x" * max(1, schema.get("minLength", 1))
    if kind == "boolean":
        return True
    if kind == "array":
        return []
    properties = schema.get("properties") or {}
    return {k: _simplest(properties.get(k)) for k in schema.get("required", [])}


def tool_call(mode: str | None, body: dict, n_out: int) -> tuple[str, str] | None:
    """The (function name, arguments text) the mock answers `body` with, the text padded to
    `n_out` characters; None when `mode` is off or the request offers no function."""
    tools = body.get("tools")
    if mode is None or not isinstance(tools, list) or not tools:
        return None
    first = tools[0].get("function") if isinstance(tools[0], dict) else None
    if not isinstance(first, dict):
        return None
    name, arguments = first.get("name", ""), "{}"
    if mode == "valid":
        arguments = json.dumps(_simplest(first.get("parameters", {})))
    elif mode == "bad_json":
        arguments = '{"unterminated'
    else:
        name = UNKNOWN_FUNCTION
    return name, arguments.ljust(n_out)


def pieces(arguments: str, n_out: int) -> list[str]:
    """The arguments text cut into `n_out` fragments, the last taking what remains."""
    n = len(arguments)
    return [arguments[i] if i < n_out - 1 else arguments[i:] for i in range(min(n_out, n))]


def delta(index: int, name: str, fragment: str) -> dict[str, Any]:
    """The `delta` of token `index`: the call's header with the first fragment, then fragments."""
    if index == 0:
        function = {"name": name, "arguments": fragment}
        return {
            "tool_calls": [{"index": 0, "id": CALL_ID, "type": "function", "function": function}]
        }
    return {"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}


def message(name: str, arguments: str) -> dict[str, Any]:
    """A non-streamed answer's `message` with the one call."""
    call = {"id": CALL_ID, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}
