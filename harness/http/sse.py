"""The one server-sent-events parser: raw timestamped socket reads in, parsed stream out.

The load loop only stores `(t_ns, bytes)` for every socket read (see `client.py`); this module
splits those reads into SSE events and decodes their JSON afterwards, so no JSON decoding sits
between the socket and the timestamp. An event's time is the arrival time of the read that
completed it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import orjson

from harness.http import sse_native
from harness.http.reasoning import delta_reasoning, split_message, split_parts
from harness.http.tool_calls import (
    ToolCallAssembler,
    ToolCallShapeError,
    message_tool_calls,
)
from slo.runrecord import ErrorClass, TokenSource

_SSE_FIELDS = (b"data", b"event", b"id", b"retry")
DONE = b"[DONE]"


_EMPTY_I64 = np.zeros(0, np.int64)
_EMPTY_I32 = np.zeros(0, np.int32)
_EMPTY_I8 = np.zeros(0, np.int8)


@dataclass(slots=True, eq=False)
class ParsedStream:
    """What one OpenAI-style SSE stream said, with a timestamp per data event.

    The chunks are columns, one entry per data event other than `[DONE]`: its time `t_ns`,
    `n_tokens` and `n_chars`, and `text_id`, the index of its text in `texts` (each distinct
    event text once, in order of first use; -1: the event has no text). A text-bearing event's
    tokens are counted from the tokens themselves where the server says them, never from the
    event count alone: the growth of the usage so far that each event carries (vLLM's
    `stream_options.continuous_usage_stats`), else the length of the choice's `token_ids`
    (vLLM's `return_token_ids`); `chunk_tokens_source` says which. Only when neither is there
    does a text event count one token (`CHUNK_COUNT`; `harness.load.records` then retokenises each
    event's text where it has a tokenizer); a text event counts at least one token either way.
    An event without text counts the tokens the server says it carries (an incomplete UTF-8
    character held back, an EOS); role-only and usage-only events count zero.

    Reasoning (`harness.http.reasoning`): `part` marks each event answer, reasoning or both
    (a `Part`); `text` is the answer text only (what output checks see) and `reasoning_text`
    the reasoning, each without `<think>` tags. An event's text in `texts` and `n_chars` is
    all it carried (reasoning and answer, tags included).
    """

    t_ns: np.ndarray = field(default_factory=lambda: _EMPTY_I64)
    n_tokens: np.ndarray = field(default_factory=lambda: _EMPTY_I64)
    n_chars: np.ndarray = field(default_factory=lambda: _EMPTY_I64)
    text_id: np.ndarray = field(default_factory=lambda: _EMPTY_I32)
    part: np.ndarray = field(default_factory=lambda: _EMPTY_I8)
    texts: list[str] = field(default_factory=list)
    text: str = ""
    reasoning_text: str = ""
    tool_calls: list | None = None  # the answer's calls (`tool_calls.ToolCall`); None: none
    finish_reason: str | None = None
    usage: dict | None = None
    response_id: str | None = None  # the `id` of the first event that has one
    saw_done: bool = False
    error_class: ErrorClass | None = None
    error_message: str | None = None
    chunk_tokens_source: TokenSource | None = None  # None: no text-bearing event

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParsedStream):
            return NotImplemented
        return all(
            np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
            for a, b in zip(self._values(), other._values(), strict=True)
        )

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    @property
    def chunks(self) -> list[tuple[int, int, int]]:
        """The chunks as `(t_ns, n_tokens, n_chars)` rows."""
        return list(
            zip(self.t_ns.tolist(), self.n_tokens.tolist(), self.n_chars.tolist(), strict=True)
        )

    def set_chunks(self, t_ns, n_tokens, n_chars, text_id=None, part=None) -> None:
        """Replace the chunk columns (`text_id` None: no chunk has a text of `texts`; `part`
        None: every chunk is answer)."""
        self.t_ns = np.asarray(t_ns, np.int64)
        self.n_tokens = np.asarray(n_tokens, np.int64)
        self.n_chars = np.asarray(n_chars, np.int64)
        self.text_id = (
            np.full(len(self.t_ns), -1, np.int32) if text_id is None else np.asarray(text_id)
        )
        self.part = np.zeros(len(self.t_ns), np.int8) if part is None else np.asarray(part, np.int8)


def split_events(
    reads: list[tuple[int, bytes]],
) -> tuple[list[tuple[int, bytes]], bytes, str | None]:
    """Split timestamped reads into `(t_ns, data_payload)` events.

    Returns the events, any trailing bytes that did not form a complete event, and an error
    message when a line is not valid SSE (neither a comment nor one of the SSE fields).
    Both `\\n\\n` and `\\r\\n\\r\\n` end an event; multi-line `data:` fields are joined by `\\n`.
    """
    events: list[tuple[int, bytes]] = []
    buffer = b""
    for t_ns, data in reads:
        buffer = buffer + data if buffer else data
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        if b"\n\n" not in buffer:
            continue
        *complete, buffer = buffer.split(b"\n\n")
        for block in complete:
            if block[:6] == b"data: " and b"\n" not in block:  # the common case, inline
                events.append((t_ns, block[6:]))
                continue
            if not block:
                continue
            payload, problem = _event_data(block)
            if problem is not None:
                return events, buffer, problem
            if payload is not None:
                events.append((t_ns, payload))
    return events, buffer, None


def _event_data(block: bytes) -> tuple[bytes | None, str | None]:
    if block.startswith(b"data: ") and b"\n" not in block:
        return block[6:], None  # the common case: one data line
    data_lines = []
    for line in block.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        name, _, value = line.partition(b":")
        if name not in _SSE_FIELDS:
            return None, f"the stream has a line that is not SSE: {line[:60]!r}"
        if name == b"data":
            data_lines.append(value[1:] if value.startswith(b" ") else value)
    return (b"\n".join(data_lines) if data_lines else None), None


_DONE_EVENT = b"data: " + DONE + b"\n\n"


def _fast_events(reads: list[tuple[int, bytes]]) -> tuple[list[int], list, bool] | None:
    """The event times, decoded events and whether `[DONE]` ended the stream, for the common
    well-formed stream (every event one `data: ` line, `\n\n` after each, nothing else), in a
    few whole-stream C-speed passes; None for anything else (the general path decides).

    A raw newline cannot occur inside a JSON text, so `\n\ndata: ` only occurs between
    events: joined with commas they are one JSON array. Each event's time is that of the read
    that brought its closing `\n\n`."""
    if not reads:
        return None
    stream = b"".join(data for _, data in reads)
    if b"\r" in stream or not stream.startswith(b"data: ") or not stream.endswith(b"\n\n"):
        return None
    if stream.count(b"\n") != 2 * stream.count(b"\n\n"):
        return None  # a multi-line event, a comment line or a blank event: not the common form
    saw_done = stream.endswith(_DONE_EVENT)
    body = stream[: -len(_DONE_EVENT)] if saw_done else stream
    try:
        objects = (
            orjson.loads(b"[" + body[6:-2].replace(b"\n\ndata: ", b",") + b"]") if body else []
        )
    except orjson.JSONDecodeError:
        return None
    newline = np.frombuffer(stream, np.uint8) == 10
    ends = np.flatnonzero(newline[1:] & newline[:-1]) + 1  # the second newline of each pair
    if ends.size != len(objects) + saw_done:
        return None
    read_ends = np.cumsum([len(data) for _, data in reads])
    which = np.searchsorted(read_ends, ends[: len(objects)], side="right")
    times = np.fromiter((t for t, _ in reads), np.int64, len(reads))[which].tolist()
    return times, objects, saw_done


def parse_stream(reads: list[tuple[int, bytes]], *, chat: bool) -> ParsedStream:
    """Parse a whole streamed response of `/v1/completions` (`chat=False`) or chat completions.

    The common form (every event one `data: ` line of a well-formed object) is read by the
    compiled scanner where there is one (`harness.http.sse_native`); anything else, and every
    stream where there is no scanner, by the Python parser below. Both give the same result."""
    scanned = sse_native.scan(reads, chat=chat)  # None for reasoning or tool-call deltas too
    if scanned is not None:
        return _from_scan(scanned)
    out = ParsedStream()
    fast = _fast_events(reads)
    if fast is not None:
        times, objects, out.saw_done = fast
        trailing, problem = b"", None
    else:
        events, trailing, problem = split_events(reads)
        done_at = next((i for i, (_, payload) in enumerate(events) if payload == DONE), None)
        if done_at is not None:
            out.saw_done = True
            if done_at != len(events) - 1:
                return _fail(out, ErrorClass.MALFORMED_SSE, "the stream sent data after [DONE]")
            events = events[:done_at]
        objects = _decode_all([payload for _, payload in events])
        if isinstance(objects, str):
            return _fail(out, ErrorClass.MALFORMED_JSON, objects)
        times = [t_ns for t_ns, _ in events]
    contents: list[str | None] = []  # per event: its content (or text), and its reasoning
    thoughts: list[str | None] = []
    text_ids: dict[str, int] = {}
    # per event: n_chars (0: no text), its text's id, the usage so far, len(token_ids)
    chars: list[int] = []
    ids_of_text: list[int] = []
    said: list[int] = []
    n_ids: list[int] = []
    failed = None
    tools = ToolCallAssembler()
    for obj in objects:
        if type(obj) is not dict:
            failed = (ErrorClass.MALFORMED_JSON, "an event is JSON but not an object")
            break
        choices = obj.get("choices")
        if "error" in obj:
            failed = (ErrorClass.STREAM_ERROR, _error_text(obj["error"]))
            break
        usage = obj.get("usage")
        if usage:
            out.usage = usage
        if out.response_id is None and type(obj.get("id")) is str:
            out.response_id = obj["id"]
        text = token_ids = thought = None
        tool_text = ""
        if choices:
            choice = choices[0] if type(choices) is list else None
            if type(choice) is not dict:
                failed = (
                    ErrorClass.MALFORMED_JSON,
                    "an event lacks the expected choices structure",
                )
                break
            if chat:
                delta = choice.get("delta")
                text = delta.get("content") if type(delta) is dict else None
                thought = delta_reasoning(delta)
                if type(delta) is dict and delta.get("tool_calls") is not None:
                    try:  # argument fragments make an output event, not answer text
                        tool_text = tools.add(delta["tool_calls"])
                    except ToolCallShapeError as exc:
                        failed = (ErrorClass.MALFORMED_JSON, str(exc))
                        break
            else:
                text = choice.get("text")
            token_ids = choice.get("token_ids")
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
        elif choices is not None and type(choices) is not list:
            failed = (ErrorClass.MALFORMED_JSON, "an event lacks the expected choices structure")
            break
        if text:
            if type(text) is not str:
                failed = (ErrorClass.MALFORMED_JSON, "an event's text is not a string")
                break
        contents.append(text or None)
        thoughts.append(thought)
        if thought:
            text = thought + text if text else thought
        if tool_text:
            text = text + tool_text if text else tool_text
        if text:
            ids_of_text.append(text_ids.setdefault(text, len(text_ids)))
        else:
            ids_of_text.append(-1)
        chars.append(len(text) if text else 0)
        completion = usage.get("completion_tokens") if type(usage) is dict else None
        said.append(
            completion if type(completion) is int and _I64 < completion < -_I64 else NO_USAGE
        )
        n_ids.append(len(token_ids) if type(token_ids) is list else -1)
    split = split_parts(contents, thoughts)
    out.text, out.reasoning_text = split.answer, split.reasoning
    out.tool_calls = tools.calls() if tools.seen else None
    if failed is not None:
        return _fail(out, *failed)  # a broken event keeps no chunk, as ever
    out.texts = list(text_ids)
    _set_counted_chunks(
        out,
        np.array(times, np.int64),
        np.array(chars, np.int64),
        np.array(ids_of_text, np.int32),
        np.array(said, np.int64),
        np.array(n_ids, np.int64),
    )
    out.part = split.part
    if problem is not None:
        return _fail(out, ErrorClass.MALFORMED_SSE, problem)
    if trailing.strip():
        return _fail(out, ErrorClass.INCOMPLETE_STREAM, "the stream ended inside an event")
    return _check_done(out)


def _check_done(out: ParsedStream) -> ParsedStream:
    if not out.saw_done:
        return _fail(out, ErrorClass.INCOMPLETE_STREAM, "the stream ended before [DONE]")
    return out


def _from_scan(scanned: sse_native.Scan) -> ParsedStream:
    out = ParsedStream(saw_done=scanned.saw_done)
    out.text = scanned.text.decode()
    out.texts = [text.decode() for text in scanned.distinct]
    if scanned.response_id is not None:
        out.response_id = orjson.loads(scanned.response_id)
    if scanned.finish_reason is not None:
        out.finish_reason = orjson.loads(scanned.finish_reason)
    if scanned.usage_object is not None:
        out.usage = orjson.loads(scanned.usage_object)
    _set_counted_chunks(
        out, scanned.t_ns, scanned.chars, scanned.text_id, scanned.usage, scanned.n_ids
    )
    return _check_done(out)


NO_USAGE = sse_native.NONE_USAGE  # an event that carries no usage so far
_I64 = NO_USAGE  # a usage so far outside int64 counts as none (orjson reads up to uint64)


def _set_counted_chunks(
    out: ParsedStream,
    t_ns: np.ndarray,
    chars: np.ndarray,
    text_id: np.ndarray,
    usage: np.ndarray,
    n_ids: np.ndarray,
) -> None:
    """Set the chunk columns, with each event's tokens and what counted them (None: no text).

    The usage so far is used only when every text event carries it (a server that puts its
    one final usage on the last text event would otherwise credit that event with every
    token); then every event that carries it counts its growth since the previous one that
    did, text or not: a server holding back an incomplete UTF-8 character sends its tokens in
    events without text, and an EOS lands on the finishing event. Else `token_ids` when every
    text event has them, and every event counts the ids it carries. Else one per text event,
    none per event without text. A text event counts at least one, an event never below 0.
    """
    has_text = chars > 0
    # the first text event (argmax finds the first True), checked first: a server that sends no
    # usage so far (or no token_ids) shows it there, without a pass over every event
    first = int(has_text.argmax()) if has_text.size else 0
    if not has_text.size or not has_text[first]:
        out.set_chunks(t_ns, np.zeros(len(t_ns), np.int64), chars, text_id)
        return
    if usage[first] != NO_USAGE and (usage[has_text] != NO_USAGE).all():
        out.chunk_tokens_source = TokenSource.USAGE
        counted = usage != NO_USAGE
        n_tokens = np.zeros(len(t_ns), np.int64)
        n_tokens[counted] = np.diff(usage[counted], prepend=0)
    elif n_ids[first] >= 0 and (n_ids[has_text] >= 0).all():
        out.chunk_tokens_source = TokenSource.TOKEN_IDS
        n_tokens = np.maximum(n_ids.astype(np.int64), 0)  # -1: the event has no token_ids
    else:  # one token per text event: the common case
        out.chunk_tokens_source = TokenSource.CHUNK_COUNT
        out.set_chunks(t_ns, has_text.astype(np.int64), chars, text_id)
        return
    floor = has_text.astype(np.int64)  # a text event counts at least one
    out.set_chunks(t_ns, np.maximum(n_tokens, floor), chars, text_id)


def _decode_all(payloads: list[bytes]) -> list | str:
    """Decode every event's JSON in one call (one array); on failure find the bad event."""
    if not payloads:
        return []
    try:
        objects = orjson.loads(b"[" + b",".join(payloads) + b"]")
        if len(objects) == len(payloads):
            return objects
    except orjson.JSONDecodeError:
        pass
    objects = []
    for payload in payloads:
        try:
            objects.append(orjson.loads(payload))
        except orjson.JSONDecodeError:
            return f"an event is not JSON: {payload[:60]!r}"
    return objects


def _error_text(error) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error)[:300]


def _fail(out: ParsedStream, error_class: ErrorClass, message: str) -> ParsedStream:
    out.error_class = error_class
    out.error_message = message
    return out


def parse_body(body: bytes, *, chat: bool) -> ParsedStream:
    """Parse a non-streamed JSON response into the same shape (its text is one chunk)."""
    out = ParsedStream(saw_done=True)
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _fail(out, ErrorClass.MALFORMED_JSON, f"the response is not JSON: {body[:60]!r}")
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list) or not obj["choices"]:
        return _fail(out, ErrorClass.MALFORMED_JSON, "the response lacks a choices list")
    choice = obj["choices"][0]
    message = choice.get("message") or {}
    text = message.get("content") if chat else choice.get("text")
    if text is not None and not isinstance(text, str):
        return _fail(out, ErrorClass.MALFORMED_JSON, "the response's text is not a string")
    out.text, out.reasoning_text = split_message(text, message if chat else None)
    try:
        out.tool_calls = message_tool_calls(message) if chat else None
    except ToolCallShapeError as exc:
        return _fail(out, ErrorClass.MALFORMED_JSON, str(exc))
    out.finish_reason = choice.get("finish_reason")
    out.usage = obj.get("usage")
    out.response_id = obj["id"] if isinstance(obj.get("id"), str) else None
    return out
