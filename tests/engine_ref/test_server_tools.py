"""Tools on the chat endpoint, over HTTP on tiny-random: `tool_choice` required and named
constrain the output to valid calls (checked with jsonschema), answered as `tool_calls`
(streamed: a header delta with id, type and name, then argument fragments) with finish_reason
`tool_calls`; `auto` and `none` answer in text; bad tool input is a 400 of one sentence, and
so is a forcing choice without the grammar library. The call reader is also checked alone:
text fed in any pieces gives the same calls."""

from __future__ import annotations

import json
import sys

import openai
import pytest
from grammar_marks import requires_grammar
from server_fixtures import running_server
from test_server import _config

from engine_ref.core import grammar
from engine_ref.serving.errors import ApiError
from engine_ref.serving.interface import GuidedDecoding
from engine_ref.serving.tools import MAX_PARALLEL_CALLS, ToolCallStream, ToolRequest, parse_tools

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "rain": {"type": "number", "minimum": 0, "maximum": 1},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "alert": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
EMPTY = {"type": "object", "properties": {}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "parameters": EMPTY}},
]
SCHEMAS = {"get_weather": WEATHER, "ping": EMPTY}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url():
    with running_server(_config()) as base:
        yield base


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def _create(url: str, **kwargs):
    with _client(url) as client:
        return client.chat.completions.create(
            model="tiny-random", messages=MESSAGES, max_tokens=600, temperature=1.0, **kwargs
        )


def _valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@requires_grammar
@pytest.mark.parametrize("parallel, most", [(False, 1), (True, MAX_PARALLEL_CALLS)])
def test_required_answers_with_valid_calls(url, parallel, most):
    out = _create(url, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, n=4)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = choice.message.tool_calls
        assert 1 <= len(calls) <= most
        assert len({c.id for c in calls}) == len(calls)
        for call in calls:
            assert call.type == "function" and call.function.name in SCHEMAS
            _valid(call.function.name, call.function.arguments)


@requires_grammar
def test_a_named_function_is_the_one_called(url):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = _create(url, tools=TOOLS, tool_choice=choice, n=3)
    for c in out.choices:
        (call,) = c.message.tool_calls
        assert (c.finish_reason, call.function.name) == ("tool_calls", "get_weather")
        _valid("get_weather", call.function.arguments)


@requires_grammar
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_stream_opens_each_call_then_sends_argument_fragments(url, tool_choice):
    with _client(url) as client:
        stream = client.chat.completions.create(
            model="tiny-random", messages=MESSAGES, max_tokens=600, tools=TOOLS,
            tool_choice=tool_choice, parallel_tool_calls=True, stream=True,
        )  # fmt: skip
        chunks = [c for c in stream if c.choices]
    calls: dict[int, dict] = {}
    fragments = 0
    for chunk in chunks:
        for item in chunk.choices[0].delta.tool_calls or []:
            if item.index not in calls:  # the opening delta: id, type, name
                assert item.id and item.type == "function" and item.function.name in SCHEMAS
                calls[item.index] = {"name": item.function.name, "arguments": ""}
            else:
                assert item.id is None and item.function.name is None
                fragments += 1
            calls[item.index]["arguments"] += item.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert sorted(calls) == list(range(len(calls))) and calls and fragments >= len(calls)
    for call in calls.values():
        _valid(call["name"], call["arguments"])
    assert all(c.choices[0].delta.content in (None, "") for c in chunks)


@pytest.mark.parametrize("tool_choice", ["auto", "none", None])
def test_auto_and_none_answer_in_text(url, tool_choice):
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    out = _create(url, tools=TOOLS, max_completion_tokens=8, **extra)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


def _bad(url: str, **kwargs) -> str:
    with _client(url) as client, pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-random", messages=MESSAGES, max_tokens=4, **kwargs
        )
    message = info.value.body["message"]
    assert message.endswith(".") and "\n" not in message and "Traceback" not in message
    return message


def _function(**function) -> list[dict]:
    return [{"type": "function", "function": function}]


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"tools": {"name": "x"}}, "tools must be a non-empty list"),
        ({"tools": []}, "tools must be a non-empty list"),
        ({"tools": [{"name": "x"}]}, 'tools[0] must be {"type": "function"'),
        ({"tools": _function(description="no name")}, "tools[0].function.name must be"),
        ({"tools": _function(name="has space")}, "tools[0].function.name must be"),
        ({"tools": TOOLS + TOOLS[:1]}, "two functions named 'get_weather'"),
        ({"tools": _function(name="f", parameters=[1])}, "parameters must be a JSON schema"),
        ({"tools": _function(name="f", parameters={"type": "string"})}, "of an object"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice names 'nope', which is not among the tools",
        ),  # fmt: skip
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls must be true"),
    ],
)
def test_bad_tool_input_is_a_400_of_one_sentence(url, kwargs, says):
    assert says in _bad(url, **kwargs)


@requires_grammar
def test_a_schema_the_grammar_rejects_and_a_second_constraint_are_400s(url):
    bad = _function(name="f", parameters={"type": "object", "properties": {"a": {"type": "x"}}})
    assert "tool_choice 'required' needs a grammar for the tools" in _bad(
        url, tools=bad, tool_choice="required"
    )
    both = _bad(url, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert "may set no other output constraint" in both
    # The server keeps serving.
    assert _create(url, tools=TOOLS, tool_choice="required").choices[0].message.tool_calls


def test_without_the_grammar_library_a_forcing_choice_is_a_400(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    grammar.check_guided.cache_clear()
    try:
        with pytest.raises(ApiError) as info:
            parse_tools({"tools": TOOLS, "tool_choice": "required"})
        assert info.value.status == 400
        assert "needs the xgrammar library" in info.value.message
        assert parse_tools({"tools": TOOLS, "tool_choice": "auto"}) is None  # no grammar needed
    finally:
        grammar.check_guided.cache_clear()


REQUIRED = ToolRequest(SCHEMAS, None, True, GuidedDecoding("json_object"))
TEXT = (
    '[{"name": "get_weather", "arguments": {"city": "a\\"b}[", "days": 3, "rain": 0.25}}, '
    '{"name": "ping", "arguments": {}}]'
)


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(TEXT)])
def test_the_call_reader_gives_the_same_calls_for_any_pieces(size):
    """Quotes, escapes and brackets inside a string value, `{}` arguments, two calls: read
    in pieces of `size` characters (cut anywhere), the calls and the deltas' joined
    fragments are those of the whole text."""
    stream = ToolCallStream(REQUIRED, "call")
    joined: dict[int, str] = {}
    names = {}
    for start in range(0, len(TEXT), size):
        for entry in stream.feed(TEXT[start : start + size]):
            if "id" in entry:
                names[entry["index"]] = entry["function"]["name"]
            joined[entry["index"]] = joined.get(entry["index"], "") + entry["function"]["arguments"]
    expected = ['{"city": "a\\"b}[", "days": 3, "rain": 0.25}', "{}"]
    assert [c["function"]["arguments"] for c in stream.calls()] == expected
    assert [joined[0], joined[1]] == expected
    assert names == {0: "get_weather", 1: "ping"}
    assert [c["id"] for c in stream.calls()] == ["call-0", "call-1"]


def test_a_named_call_opens_at_the_first_token():
    stream = ToolCallStream(ToolRequest(SCHEMAS, "ping", False, GuidedDecoding("json_object")), "c")
    first = stream.feed("{")
    assert first == [{"index": 0, "id": "c-0", "type": "function",
                      "function": {"name": "ping", "arguments": "{"}}]  # fmt: skip
    assert stream.feed("}") == [{"index": 0, "function": {"arguments": "}"}}]
    assert stream.feed("") == []
    assert stream.calls()[0]["function"] == {"name": "ping", "arguments": "{}"}
