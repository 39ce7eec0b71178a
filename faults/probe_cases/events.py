"""Bad requests to the typed-event APIs: OpenAI's Responses (`/v1/responses`) and Anthropic's
Messages (`/v1/messages`): a malformed body, fields of the wrong type, a missing input or
output bound, an unknown model. Every one must be rejected with a 4xx and an error body (both
APIs' error shapes carry `error.message`).

Not every server serves these routes. `ROUTE_CHECKS` holds one well-formed request per route:
the probe sends it first, and a route that answers it 404 (or 405) is not served, so its cases
are reported as not served rather than failed (`probe.py`). Wrong values are ones no lenient
parser coerces (a word where a number is due, not `"8"`), so each case has one right answer.
"""

from __future__ import annotations

from typing import Any

from faults.probe_cases.case import DROP, REJECT, Category, ProbeCase, encode

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
ANTHROPIC_HEADERS = (("anthropic-version", "2023-06-01"),)


def _merged(base: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in {**base, **fields}.items() if v is not DROP}


def responses_body(model: str, /, **fields: Any) -> dict[str, Any]:
    """A well-formed short Responses request with `fields` replaced (`DROP` removes one)."""
    return _merged({"model": model, "input": "Hello", "max_output_tokens": 8}, fields)


def messages_body(model: str, /, **fields: Any) -> dict[str, Any]:
    """A well-formed short Messages request with `fields` replaced (`DROP` removes one)."""
    messages = [{"role": "user", "content": "Hello"}]
    return _merged({"model": model, "messages": messages, "max_tokens": 8}, fields)


def route_checks(model: str) -> dict[str, tuple[bytes, tuple[tuple[str, str], ...]]]:
    """route -> (a well-formed non-streamed body, its headers): what tells whether a server
    serves the route at all."""
    return {
        RESPONSES: (encode(responses_body(model)), ()),
        MESSAGES: (encode(messages_body(model)), ANTHROPIC_HEADERS),
    }


def event_apis(model: str) -> list[ProbeCase]:
    cat = Category.EVENT_APIS

    def responses(name: str, summary: str, body: bytes | None = None, **fields) -> ProbeCase:
        body = encode(responses_body(model, **fields)) if body is None else body
        return ProbeCase(f"responses-{name}", cat, summary, REJECT, body, path=RESPONSES)

    def messages(name: str, summary: str, body: bytes | None = None, **fields) -> ProbeCase:
        body = encode(messages_body(model, **fields)) if body is None else body
        return ProbeCase(
            f"messages-api-{name}", cat, summary, REJECT, body, path=MESSAGES,
            headers=ANTHROPIC_HEADERS,
        )  # fmt: skip

    good_responses = encode(responses_body(model))
    good_messages = encode(messages_body(model))
    other = "no-such-model-probe"
    return [
        responses("truncated-json", "body cut mid-string", good_responses[:-12]),
        responses("input-missing", "no input", input=DROP),
        responses("input-number", "input: 42", input=42),
        responses("input-empty-list", "input: []", input=[]),
        responses("input-bad-role", 'input: [{"role": "robot"}]', input=[{"role": "robot", "content": "Hi"}]),
        responses("max-output-tokens-word", 'max_output_tokens: "many"', max_output_tokens="many"),
        responses("max-output-tokens-zero", "max_output_tokens: 0", max_output_tokens=0),
        responses("temperature-word", 'temperature: "hot"', temperature="hot"),
        responses("unknown-model", f"model: {other!r}", model=other),
        messages("truncated-json", "body cut mid-string", good_messages[:-9]),
        messages("max-tokens-missing", "no max_tokens", max_tokens=DROP),
        messages("max-tokens-word", 'max_tokens: "many"', max_tokens="many"),
        messages("max-tokens-zero", "max_tokens: 0", max_tokens=0),
        messages("messages-missing", "no messages", messages=DROP),
        messages("messages-string", 'messages: "Hello"', messages="Hello"),
        messages("system-role", 'messages: [{"role": "system"}]', messages=[{"role": "system", "content": "Hi"}]),
        messages("content-number", "content: 42", messages=[{"role": "user", "content": 42}]),
        messages("temperature-word", 'temperature: "hot"', temperature="hot"),
        messages("unknown-model", f"model: {other!r}", model=other),
    ]  # fmt: skip
