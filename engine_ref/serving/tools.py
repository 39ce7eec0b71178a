"""Function calling on the chat endpoint: `tools`, `tool_choice` and `parallel_tool_calls` read
into a grammar, and the constrained output rendered back as OpenAI's `tool_calls`.

The engine has no free-form tool-call parser, so only a choice that forces calls uses the
tools. `tool_choice: "required"` constrains the output (xgrammar, as `response_format` does)
to a JSON array of `{"name": <an offered function>, "arguments": <its parameters>}` objects,
at least one, exactly one when `parallel_tool_calls` is false and at most
`MAX_PARALLEL_CALLS` otherwise (the engine's own bound: a model that never closes the array
still ends, as OpenAI documents none); a named function
(`{"type": "function", "function": {"name": ...}}`) constrains it to that function's
arguments object. Either way the calls are valid by construction, and the answer is
`message.tool_calls` with `content` null and finish_reason `tool_calls` (`length` when
max_tokens cut it; the arguments are then incomplete). `"auto"` (the default when tools are
given) and `"none"` ignore the tools: the model answers in plain text, as `none` asks.

Streamed, a call opens with a delta carrying its index, id, type and function name (when
the name is complete, or at the first token of a named call), then its `function.arguments`
arrive in fragments as the tokens do. Tokens that carry only the array's punctuation give an
empty delta, so a chunk still follows every engine output.

Bad tool input is a 400 with one sentence: tools not a list of functions, a function without
a valid name, two functions of one name, parameters that are not an object schema (or that
the grammar compiler rejects), a named choice not offered, a forcing choice together with
another output constraint, or no grammar library installed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine_ref.serving.errors import ApiError
from engine_ref.serving.fields import shown
from engine_ref.serving.interface import GrammarError, GuidedDecoding, check_guided

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name
_NO_PARAMETERS = {"type": "object", "properties": {}}
CHOICES = ("none", "auto", "required")
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ToolRequest:
    """A request whose tools the engine serves: the offered functions' parameter schemas by
    name, the function a named choice forces (None: `required`), whether several calls may
    come at once, and the grammar of the output."""

    parameters: dict[str, dict[str, Any]]
    named: str | None
    parallel: bool
    guided: GuidedDecoding


def _fail(message: str, param: str = "tools") -> ApiError:
    return ApiError(400, message, param=param)


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """The offered functions' parameter schemas by name, in order."""
    if not isinstance(tools, list) or not tools:
        raise _fail(f"tools must be a non-empty list of functions, got {shown(tools)}.")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
        ):
            raise _fail(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}.')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _fail(
                f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -, "
                f"got {shown(name)}."
            )
        if name in functions:
            raise _fail(f"tools has two functions named {name!r}.")
        parameters = function.get("parameters", _NO_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise _fail(f"tools[{i}].function.parameters must be a JSON schema of an object.")
        functions[name] = parameters
    return functions


def _choice(value: Any, functions: dict[str, dict[str, Any]]) -> str:
    """The choice: "none", "auto", "required", or the name of the function it forces."""
    if value is None:
        return "auto"
    if isinstance(value, str) and value in CHOICES:
        return value
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise _fail(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            f'"function": {{"name": ...}}}}, got {shown(value)}.',
            "tool_choice",
        )
    if name not in functions:
        raise _fail(f"tool_choice names {name!r}, which is not among the tools.", "tool_choice")
    return name


def calls_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The output of `required`: an array of one call (up to `MAX_PARALLEL_CALLS` when
    `parallel`), each `{"name": <function>, "arguments": <its parameters>}`, name first."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in functions.items()
    ]
    return {
        "type": "array",
        "items": {"anyOf": calls},
        "minItems": 1,
        "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
    }


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools when its `tool_choice` forces calls, else None (no tools, or
    `auto`/`none`, which ignore them); ApiError 400 for bad tool input."""
    tools = body.get("tools")
    if tools is None:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise _fail("tool_choice needs tools.", "tool_choice")
        return None
    functions = _functions(tools)
    choice = _choice(body.get("tool_choice"), functions)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _fail(f"parallel_tool_calls must be true or false, got {shown(parallel)}.",
                    "parallel_tool_calls")  # fmt: skip
    if choice in ("none", "auto"):
        return None
    named = None if choice == "required" else choice
    schema = functions[named] if named is not None else calls_schema(functions, parallel)
    try:
        guided = GuidedDecoding.json_schema(json.dumps(schema, ensure_ascii=False))
        check_guided(guided)
    except GrammarError as exc:
        raise _fail(f"tool_choice {choice!r} needs a grammar for the tools: {exc}") from None
    except (TypeError, ValueError, RecursionError):
        raise _fail("tools hold a parameters schema that cannot be encoded.") from None
    return ToolRequest(functions, named, parallel, guided)


class ToolCallStream:
    """One choice's calls, read from its constrained output text as it grows.

    `feed(text)` takes the text a chunk adds and returns the `tool_calls` delta entries for
    it; `calls()` is the whole list afterwards (a non-streamed answer feeds all its text at
    once). The reader follows JSON strings and nesting only: the grammar makes the shape."""

    def __init__(self, request: ToolRequest, id_prefix: str) -> None:
        self.request = request
        self.id_prefix = id_prefix
        self.names: list[str | None] = []
        self.arguments: list[list[str]] = []
        self.sent_header: list[bool] = []
        self.unsent: list[list[str]] = []
        # the array reader's state (required); a named call's text is all arguments
        self.depth = 0
        self.in_string = self.escape = False
        self.string: list[str] = []
        self.key: str | None = None
        self.reading_key = False
        self.args_depth: int | None = None  # nesting inside the arguments value being read
        self.args_string = self.args_escape = False
        if request.named is not None:
            self._open(request.named)

    def _open(self, name: str | None) -> None:
        self.names.append(name)
        self.arguments.append([])
        self.sent_header.append(False)
        self.unsent.append([])

    def _argument(self, ch: str) -> None:
        self.arguments[-1].append(ch)
        self.unsent[-1].append(ch)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.request.named is not None:
            for ch in text:
                self._argument(ch)
        else:
            for ch in text:
                self._read(ch)
        return self._entries()

    def _entries(self) -> list[dict[str, Any]]:
        entries = []
        for k, name in enumerate(self.names):
            if name is None:
                continue  # arguments before the name: held until the name comes
            fragment = "".join(self.unsent[k])
            self.unsent[k] = []
            if not self.sent_header[k]:
                self.sent_header[k] = True
                function = {"name": name, "arguments": fragment}
                entries.append(
                    {"index": k, "id": self._id(k), "type": "function", "function": function}
                )
            elif fragment:
                entries.append({"index": k, "function": {"arguments": fragment}})
        return entries

    def _id(self, k: int) -> str:
        return f"{self.id_prefix}-{k}"

    def _read(self, ch: str) -> None:
        """One character of `[{"name": ..., "arguments": ...}, ...]`."""
        if self.args_depth is not None and self._read_arguments(ch):
            return
        if self.in_string:
            if self.escape:
                self.escape = False
                self.string.append(ch)
            elif ch == "\\":
                self.escape = True
                self.string.append(ch)
            elif ch == '"':
                self.in_string = False
                self._string_done(json.loads('"' + "".join(self.string) + '"'))
            else:
                self.string.append(ch)
        elif ch == '"':
            self.in_string, self.string = True, []
        elif ch in "{[":
            self.depth += 1
            if self.depth == 2 and ch == "{":  # a call opens
                self._open(None)
                self.reading_key = True
        elif ch in "}]":
            self.depth -= 1
        elif ch == ":" and self.depth == 2:
            self.reading_key = False
            if self.key == "arguments" and self.names:
                self.args_depth = 0
        elif ch == "," and self.depth == 2:
            self.reading_key = True

    def _string_done(self, value: str) -> None:
        if self.depth != 2 or not self.names:
            return
        if self.reading_key:
            self.key = value
        elif self.key == "name":
            self.names[-1] = value

    def _read_arguments(self, ch: str) -> bool:
        """Take `ch` into the arguments value being read; False when `ch` ends a value that
        has no closing character of its own (a number, true, false, null), so that the
        caller reads it as the call's punctuation."""
        started = bool(self.arguments[-1])
        if not started and ch in " \t\r\n":
            return True
        if self.args_string:
            if self.args_escape:
                self.args_escape = False
            elif ch == "\\":
                self.args_escape = True
            elif ch == '"':
                self.args_string = False
                if self.args_depth == 0:
                    self.args_depth = None  # a string value ends with its quote
            self._argument(ch)
            return True
        if self.args_depth == 0 and started and ch in ",}":
            self.args_depth = None
            return False
        self._argument(ch)
        if ch == '"':
            self.args_string = True
        elif ch in "{[":
            self.args_depth += 1
        elif ch in "}]":
            self.args_depth -= 1
            if self.args_depth == 0:
                self.args_depth = None
        return True

    def calls(self) -> list[dict[str, Any]]:
        """The calls so far as `message.tool_calls` entries (calls without a name yet left
        out: an output cut before its name)."""
        return [
            {
                "id": self._id(k),
                "type": "function",
                "function": {"name": name, "arguments": "".join(self.arguments[k])},
            }
            for k, name in enumerate(self.names)
            if name is not None
        ]


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """`tool_calls` for an output that ended as the grammar allows with calls in it."""
    return "tool_calls" if reason == "stop" and has_calls else reason


def tool_message(stream: ToolCallStream, text: str) -> dict[str, Any]:
    """A non-streamed answer's `message`: its calls, content null."""
    stream.feed(text)
    return {"role": "assistant", "content": None, "tool_calls": stream.calls()}


def tool_delta(stream: ToolCallStream, text: str) -> dict[str, Any]:
    """A stream chunk's `delta`: the `tool_calls` entries its text adds (empty: none)."""
    entries = stream.feed(text)
    return {"tool_calls": entries} if entries else {}


def choice_stream(
    request: ToolRequest | None, response_id: str, index: int
) -> ToolCallStream | None:
    """The call reader of choice `index` of a request whose tools force calls, else None."""
    return None if request is None else ToolCallStream(request, f"call-{response_id}-{index}")
