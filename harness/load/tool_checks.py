"""The output check of a request that offered tools: are the answer's function calls valid?

A call is invalid when its arguments are not JSON text (an empty string included; a function
without parameters takes `{}`), when it calls a function the request did not offer, or when
its arguments do not match that function's `parameters` schema (jsonschema; a workload with
tools needs it, `require_jsonschema` says so before a run starts). The answer as a whole is
invalid when `tool_choice` was `required` and it made no call, when the choice named a
function and it made none or called another, or when the choice was `none` and it called one
anyway. Under `auto` no call is fine. The number of calls is recorded, not judged (a
`parallel` request answered with one call is valid: BFCL's parallel category scores that as
inaccurate, not as malformed).
"""

from __future__ import annotations

import json
from typing import Any

from harness.errors import HarnessError
from harness.http.tool_calls import ToolCall
from workloads.schema import WorkloadError
from workloads.tools import ToolOffer, arguments_error


def require_jsonschema() -> None:
    """HarnessError (one sentence) unless jsonschema is installed: checking tool calls needs it."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        raise HarnessError(
            "This workload offers tools, and checking the calls needs the jsonschema package "
            "(pip install jsonschema)."
        ) from None


def call_problem(offer: ToolOffer, call: ToolCall) -> str | None:
    """Why one call is invalid (one sentence), or None."""
    function = offer.by_name.get(call.name)
    if function is None:
        return f"The answer calls {call.name!r}, which the request did not offer."
    try:
        arguments: Any = json.loads(call.arguments)
    except ValueError:
        return f"The arguments of {call.name!r} are not valid JSON: {call.arguments[:60]!r}."
    try:
        error = arguments_error(function["parameters"], arguments)
    except WorkloadError as exc:  # jsonschema went missing after the run started
        return str(exc)
    if error is not None:
        return f"The arguments of {call.name!r} do not match its schema: {error}."
    return None


def tool_call_problem(offer: ToolOffer, calls: list[ToolCall] | None) -> str | None:
    """Why the answer's calls (None or []: it made none) break the request's offer, or None."""
    calls = calls or []
    if offer.choice == "none":
        if calls:
            return f"tool_choice was none, yet the answer calls {calls[0].name!r}."
        return None
    if not calls and offer.choice == "required":
        return "tool_choice was required, yet the answer made no function call."
    named = offer.named
    if named is not None:
        if not calls:
            return f"tool_choice named {named!r}, yet the answer made no function call."
        other = next((c.name for c in calls if c.name != named), None)
        if other is not None:
            return f"tool_choice named {named!r}, yet the answer calls {other!r}."
    for call in calls:
        problem = call_problem(offer, call)
        if problem is not None:
            return problem
    return None


def tool_call_count(calls: list[ToolCall] | None, offered: bool, answered: bool) -> int | None:
    """The `num_tool_calls` column: how many calls the answer made; 0 for an answer without
    calls to a request that `offered` tools; None when there was no answer (not `answered`)
    or neither side spoke of tools."""
    if calls is not None:
        return len(calls)
    return 0 if offered and answered else None
