"""Function calls in answers: streamed `delta.tool_calls` fragments assembled (0, 1 and many
calls, fragments cut inside a string, index gaps, missing indexes, empty `{}` arguments), a
non-streamed `message.tool_calls` read, fragment events counted as output events, and the
`tool_call_invalid` check of each way a call can be wrong, through the record a request gets."""

from __future__ import annotations

import orjson
import pytest

from harness.http import sse_native
from harness.http.client import ClientOptions, RawResult, body_fields
from harness.http.sse import parse_body, parse_stream
from harness.http.tool_calls import ToolCall
from harness.load.output_checks import Expectation, OutputChecks
from harness.load.records import RecordContext, to_rows
from harness.load.tool_checks import tool_call_problem
from slo.runrecord import ErrorClass, OutputFlag
from workloads.tools import ToolOffer

pytest.importorskip("jsonschema")

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
}
PING = {"name": "ping", "parameters": {"type": "object", "properties": {}}}
OFFER = (WEATHER, PING)


def _event(t_ns: int, delta: dict, finish: str | None = None) -> tuple[int, bytes]:
    body = {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return t_ns, b"data: " + orjson.dumps(body) + b"\n\n"


def _calls(*deltas) -> dict:
    return {"tool_calls": list(deltas)}


def _head(index: int, name: str, arguments: str = "", id_: str | None = "call-x") -> dict:
    item = {"index": index, "type": "function", "function": {"name": name, "arguments": arguments}}
    return item | ({"id": id_} if id_ is not None else {})


def _frag(index: int | None, arguments: str) -> dict:
    item = {"function": {"arguments": arguments}}
    return item | ({"index": index} if index is not None else {})


def _stream(*deltas: dict) -> list[tuple[int, bytes]]:
    reads = [_event(100, {"role": "assistant", "content": ""})]
    reads += [_event(200 + 100 * k, d) for k, d in enumerate(deltas)]
    reads.append(_event(900, {}, "tool_calls"))
    reads.append((950, b"data: [DONE]\n\n"))
    return reads


def _summary(calls: list[ToolCall] | None) -> list[tuple[int, str, str]] | None:
    return None if calls is None else [(c.index, c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(
    "deltas, expected",
    [
        # 0 calls: a text answer has no tool_calls at all
        (({"content": "hi"},), None),
        # an empty tool_calls list: seen, but no call
        ((_calls(),), []),
        # 1 call, its arguments cut inside a string and inside a key
        (
            (
                _calls(_head(0, "get_weather")),
                _calls(_frag(0, '{"ci')),
                _calls(_frag(0, 'ty": "Par')),
                _calls(_frag(0, 'is"}')),
            ),
            [(0, "get_weather", '{"city": "Paris"}')],
        ),
        # empty arguments `{}` in the opening delta itself
        ((_calls(_head(0, "ping", "{}")),), [(0, "ping", "{}")]),
        # many calls, interleaved in one event and across events
        (
            (
                _calls(_head(0, "get_weather"), _head(1, "ping")),
                _calls(_frag(1, "{}"), _frag(0, '{"city": "Oslo"}')),
                _calls(_head(2, "get_weather", '{"city": "Rome", "days": 3}')),
            ),
            [
                (0, "get_weather", '{"city": "Oslo"}'),
                (1, "ping", "{}"),
                (2, "get_weather", '{"city": "Rome", "days": 3}'),
            ],
        ),
        # an index gap (0, then 2): kept as it came, in index order
        (
            (_calls(_head(2, "ping", "{}")), _calls(_head(0, "ping", "{}"))),
            [(0, "ping", "{}"), (2, "ping", "{}")],
        ),
        # no index: a fragment continues the last call, an id opens the next
        (
            (
                _calls({"id": "a", "function": {"name": "ping", "arguments": "{"}}),
                _calls(_frag(None, "}")),
                _calls({"id": "b", "function": {"name": "ping", "arguments": "{}"}}),
            ),
            [(0, "ping", "{}"), (1, "ping", "{}")],
        ),
    ],
)
def test_streamed_tool_calls_are_assembled(deltas, expected):
    parsed = parse_stream(_stream(*deltas), chat=True)
    assert parsed.error_class is None
    assert _summary(parsed.tool_calls) == expected
    assert parsed.finish_reason == "tool_calls"


def test_fragment_events_are_output_events_and_not_answer_text():
    """The role event carries nothing; the header (name) and each fragment are output
    events: the first token is the header's time, and each event counts one token."""
    reads = _stream(
        _calls(_head(0, "get_weather")),
        _calls(_frag(0, '{"city"')),
        _calls(_frag(0, ': "Lima"}')),
    )
    parsed = parse_stream(reads, chat=True)
    assert parsed.text == ""
    assert parsed.n_tokens.tolist() == [0, 1, 1, 1, 0]
    assert parsed.t_ns[parsed.n_tokens > 0].tolist() == [200, 300, 400]
    assert parsed.n_chars.tolist() == [0, len("get_weather"), len('{"city"'), len(': "Lima"}'), 0]


@pytest.mark.parametrize("cut", [1, 5, 11, 12, 13])
def test_a_tool_call_stream_cut_anywhere_between_reads_leaves_the_scanner(cut):
    """`"tool_calls"` cut at any byte between two reads: the compiled scanner, which reads
    content only, gives up on the stream and the Python parser assembles the call."""
    blob = b"".join(data for _, data in _stream(_calls(_head(0, "ping", "{}"))))
    at = blob.index(b'"tool_calls"') + cut
    reads = [(1, blob[:at]), (2, blob[at:])]
    if sse_native.available():  # no C compiler: no scanner (test_sse_native checks it builds)
        assert sse_native.scan(reads, chat=True) is None
    assert _summary(parse_stream(reads, chat=True).tool_calls) == [(0, "ping", "{}")]


def test_a_null_tool_calls_and_the_word_in_content_keep_the_scanner():
    reads = [_event(1, {"content": "tool_calls:", "tool_calls": None}), _event(2, {}, "stop")]
    if sse_native.available():  # no C compiler: no scanner (test_sse_native checks it builds)
        scanned = sse_native.scan(reads, chat=True)
        assert scanned is not None and scanned.text == b"tool_calls:"
    assert parse_stream(reads, chat=True).text == "tool_calls:"


@pytest.mark.parametrize(
    "tool_calls, message",
    [
        ({"index": 0}, "is not a list"),
        ([3], "not an object"),
        ([{"index": -1}], "non-negative integer"),
        ([{"index": 0, "function": {"arguments": 5}}], "arguments is not a string"),
    ],
)
def test_a_tool_calls_value_of_the_wrong_shape_is_malformed(tool_calls, message):
    parsed = parse_stream(_stream({"tool_calls": tool_calls}), chat=True)
    assert parsed.error_class is ErrorClass.MALFORMED_JSON
    assert message in parsed.error_message


def test_a_non_streamed_message_carries_its_calls():
    call = {"id": "c0", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
    body = {"id": "x", "choices": [{"index": 0, "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}  # fmt: skip
    parsed = parse_body(orjson.dumps(body), chat=True)
    assert parsed.text == "" and _summary(parsed.tool_calls) == [(0, "ping", "{}")]
    plain = {"id": "x", "choices": [{"index": 0, "message": {"content": "hi"}}]}
    assert parse_body(orjson.dumps(plain), chat=True).tool_calls is None


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(0, name, arguments)


@pytest.mark.parametrize(
    "choice, calls, problem",
    [
        ("required", [_call("get_weather", '{"city": "Paris"}')], None),
        (
            "required",
            [_call("get_weather", '{"city": "Paris", "days": 14, "unit": "celsius"}')],
            None,
        ),
        ("required", [_call("ping", "{}")], None),  # empty arguments for a function without any
        ("required", [_call("ping", "{}"), _call("get_weather", '{"city": ""}')], None),
        ("required", None, "made no function call"),
        ("required", [], "made no function call"),
        ("required", [_call("ping", "")], "not valid JSON"),  # empty text is not `{}`
        ("required", [_call("get_weather", '{"city": "Par')], "not valid JSON"),  # cut short
        ("required", [_call("send_mail", "{}")], "did not offer"),
        ("required", [_call("get_weather", "{}")], "'city' is a required property"),
        ("required", [_call("get_weather", '{"city": "x", "days": 15}')], "15 is greater than"),
        ("required", [_call("get_weather", '{"city": "x", "days": 0}')], "0 is less than"),
        ("required", [_call("get_weather", '{"city": "x", "unit": "K"}')], "is not one of"),
        ("required", [_call("get_weather", '{"city": 3}')], "3 is not of type 'string'"),
        ("required", [_call("get_weather", '{"city": "x", "zip": 1}')], "Additional properties"),
        ("required", [_call("ping", "{}"), _call("get_weather", "[]")], "is not of type 'object'"),
        ("auto", None, None),  # auto: no call is fine
        ("auto", [_call("nope", "{}")], "did not offer"),  # but a call must be valid
        ("none", None, None),
        ("none", [_call("ping", "{}")], "tool_choice was none"),
        ("ping", [_call("ping", "{}")], None),
        ("ping", None, "named 'ping', yet the answer made no function call"),
        ("ping", [_call("get_weather", '{"city": "x"}')], "named 'ping', yet the answer calls"),
    ],
)
def test_tool_call_problem(choice, calls, problem):
    found = tool_call_problem(ToolOffer(OFFER, choice), calls)
    if problem is None:
        assert found is None
    else:
        assert problem in found and found.endswith(".")


class Words:
    def encode(self, text: str) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]


def _record(answer: dict, offer: ToolOffer | None):
    checks = OutputChecks(Words(), {"r": Expectation(64, False, None, offer)})
    body = {"id": "c", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": answer}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 9}}  # fmt: skip
    raw = RawResult("r", False, 0, t_sent_ns=10, t_done_ns=5_000, http_status=200,
                    body=orjson.dumps(body))  # fmt: skip
    record, _ = to_rows(raw, 3, RecordContext(t0_ns=0, is_chat=True, checks=checks))
    return record


def _message(*calls: tuple[str, str]) -> dict:
    items = [{"id": f"c{k}", "type": "function", "function": {"name": n, "arguments": a}}
             for k, (n, a) in enumerate(calls)]  # fmt: skip
    return {"role": "assistant", "content": None, "tool_calls": items}


def test_the_record_flags_invalid_calls_and_counts_them():
    offer = ToolOffer(OFFER, "required")
    good = _record(_message(("ping", "{}"), ("get_weather", '{"city": "Quito"}')), offer)
    assert (good.output_valid, good.output_flags, good.num_tool_calls) == (True, None, 2)
    bad = _record(_message(("get_weather", "{oops")), offer)
    assert (bad.output_valid, bad.output_flags, bad.num_tool_calls) == (
        False,
        OutputFlag.TOOL_CALL_INVALID.value,
        1,
    )
    none = _record({"role": "assistant", "content": "no call"}, offer)
    assert (none.output_valid, none.num_tool_calls) == (False, 0)
    # No tools offered and none called: no verdict, no count.
    plain = _record({"role": "assistant", "content": "text"}, None)
    assert (plain.output_valid, plain.num_tool_calls) == (None, None)


@pytest.mark.parametrize(
    "choice, parallel, wire_choice",
    [
        ("required", True, "required"),
        ("auto", None, "auto"),
        ("ping", False, {"type": "function", "function": {"name": "ping"}}),
    ],
)
def test_requests_carry_their_tools_on_the_wire(choice, parallel, wire_choice):
    options = ClientOptions(base_url="http://x/v1", model="m", endpoint="chat", stream=False)
    row = {"request_id": "r", "prompt": "hi", "max_output_tokens": 8}
    body = body_fields(options, {**row, "tools": ToolOffer(OFFER, choice, parallel)})
    assert body["tools"] == [{"type": "function", "function": f} for f in OFFER]
    assert body["tool_choice"] == wire_choice
    assert body.get("parallel_tool_calls") == parallel
    assert "tools" not in body_fields(options, {**row, "tools": None})


def test_a_run_with_tools_says_when_jsonschema_is_missing(monkeypatch):
    import sys

    from harness.errors import HarnessError
    from harness.load.tool_checks import require_jsonschema

    require_jsonschema()  # installed: nothing to say
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # `import jsonschema` fails
    with pytest.raises(HarnessError, match=r"needs the jsonschema package \(pip install"):
        require_jsonschema()
