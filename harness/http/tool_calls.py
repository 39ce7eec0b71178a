"""Function calls in OpenAI chat answers: assembled from streamed `delta.tool_calls` fragments,
or read whole from a non-streamed `message.tool_calls`.

A stream opens a call with a delta carrying its `index`, `id`, `type` and `function.name`,
then sends `function.arguments` in fragments (cut anywhere, even inside a JSON string) under
the same `index`; several calls may interleave. Fragments are joined per index, and the calls
come out in index order; an index gap (0 then 2) is kept as it came, not filled. A fragment
without an `index` continues the last call unless it brings an `id` (some servers leave the
index out of single-call streams).

The compiled stream scanner (`harness.http.sse_native`) reads only `content`: it gives up on a
delta whose `tool_calls` is not null, as it reads the key, and the Python parser reads the
stream instead; the common stream keeps the fast path at no cost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ToolCall:
    """One function call of an answer; `arguments` is the raw JSON text the server sent."""

    index: int
    name: str = ""
    arguments: str = ""
    id: str | None = None
    type: str | None = None


class ToolCallShapeError(ValueError):
    """A `tool_calls` value that is not OpenAI's shape; one sentence."""


def _string(value: Any, what: str) -> str:
    if value is None:
        return ""
    if type(value) is not str:
        raise ToolCallShapeError(f"a tool call's {what} is not a string")
    return value


@dataclass(slots=True)
class ToolCallAssembler:
    """The calls of one streamed choice, built up event by event."""

    by_index: dict[int, ToolCall] = field(default_factory=dict)
    last: int | None = None
    seen: bool = False  # some event had `tool_calls`, even an empty list

    def add(self, items: Any) -> str:
        """Fold one event's `delta.tool_calls` in; returns the text it carried (function name
        and argument fragments joined: what makes the event an output event). Raises
        `ToolCallShapeError` when `items` is not a list of call objects."""
        if type(items) is not list:
            raise ToolCallShapeError("an event's tool_calls is not a list")
        self.seen = True
        carried = []
        for item in items:
            if type(item) is not dict:
                raise ToolCallShapeError("an event's tool_calls holds something not an object")
            index = item.get("index")
            if index is None:
                index = len(self.by_index) if self.last is None or item.get("id") else self.last
            elif type(index) is not int or index < 0:
                raise ToolCallShapeError("a tool call's index is not a non-negative integer")
            call = self.by_index.get(index)
            if call is None:
                call = self.by_index[index] = ToolCall(index)
            self.last = index
            if item.get("id") is not None:
                call.id = _string(item["id"], "id")
            if item.get("type") is not None:
                call.type = _string(item["type"], "type")
            function = item.get("function")
            if function is None:
                continue
            if type(function) is not dict:
                raise ToolCallShapeError("a tool call's function is not an object")
            name = _string(function.get("name"), "name")
            arguments = _string(function.get("arguments"), "arguments")
            call.name += name
            call.arguments += arguments
            carried += (name, arguments)
        return "".join(carried)

    def calls(self) -> list[ToolCall]:
        """The calls so far, in index order."""
        return [self.by_index[i] for i in sorted(self.by_index)]


def message_tool_calls(message: Any) -> list[ToolCall] | None:
    """The calls of a non-streamed chat `message` (None: it has no `tool_calls`); raises
    `ToolCallShapeError` for a `tool_calls` that is not OpenAI's shape. Arguments given as
    an object rather than JSON text are kept as their JSON text."""
    if type(message) is not dict or message.get("tool_calls") is None:
        return None
    items = message["tool_calls"]
    if type(items) is not list:
        raise ToolCallShapeError("the message's tool_calls is not a list")
    calls = []
    for k, item in enumerate(items):
        if type(item) is not dict or type(item.get("function")) is not dict:
            raise ToolCallShapeError("the message's tool_calls holds something not a call")
        function = item["function"]
        arguments = function.get("arguments")
        if type(arguments) is dict:
            arguments = json.dumps(arguments)
        calls.append(
            ToolCall(
                k,
                _string(function.get("name"), "name"),
                _string(arguments, "arguments"),
                _string(item.get("id"), "id") or None,
                _string(item.get("type"), "type") or None,
            )
        )
    return calls
