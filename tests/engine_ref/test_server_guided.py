"""Guided decoding over HTTP on tiny-random: OpenAI's `response_format` and vLLM's `guided_*`
and `structured_outputs` fields constrain the output; an invalid constraint or two of them
are a 400 of one sentence and the server keeps serving; speculation keeps greedy outputs."""

from __future__ import annotations

import json
import re

import openai
import pytest
from grammar_marks import requires_grammar
from server_fixtures import running_server
from test_server import _config, _metric, _scrape

pytestmark = requires_grammar
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                   "disable_by_batch_size": None, "disable_below_acceptance_rate": 0.0})  # fmt: skip
MESSAGES = [{"role": "user", "content": "Name a capital city, in JSON."}]


@pytest.fixture(scope="module")
def url():
    with running_server(_config()) as base:
        yield base


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def _chat(url: str, **kwargs) -> list[tuple[str, str]]:
    with _client(url) as client:
        out = client.chat.completions.create(
            model="tiny-random", messages=MESSAGES, max_tokens=80, **kwargs
        )
    return [(c.message.content, c.finish_reason) for c in out.choices]


def _complete(
    url: str, prompt: str = "The capital of France is", temperature: float = 1.0, **extra
) -> tuple[str, str]:
    with _client(url) as client:
        out = client.completions.create(
            model="tiny-random",
            prompt=prompt,
            max_tokens=80,
            temperature=temperature,
            extra_body=extra,
        )
    return out.choices[0].text, out.choices[0].finish_reason


def _bad(url: str, **extra) -> str:
    with _client(url) as client, pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-random", prompt="x", max_tokens=4, extra_body=extra)
    message = info.value.body["message"]
    assert message.endswith(".") and "\n" not in message and "Traceback" not in message
    return message


def test_response_format_json_schema_on_chat(url):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}  # fmt: skip
    choices = _chat(url, response_format=response_format, n=4, temperature=1.0)
    assert len(choices) == 4
    for text, reason in choices:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object(url):
    choices = _chat(url, response_format={"type": "json_object"}, n=4, temperature=0.7, seed=1)
    stopped = [text for text, reason in choices if reason == "stop"]
    assert stopped
    for text in stopped:
        assert isinstance(json.loads(text), dict)
    _chat(url, response_format={"type": "text"})  # no constraint, accepted


@pytest.mark.parametrize(
    "fields, valid",
    [
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"guided_json": json.dumps(SCHEMA)},
         lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"guided_regex": r"\d{3}-[A-Z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[A-Z]{2}", t)),
        ({"guided_choice": ["Paris", "Rome"]}, lambda t: t in ("Paris", "Rome")),
        ({"guided_grammar": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"regex": "[ab]{4}", "disable_any_whitespace": True}},
         lambda t: re.fullmatch("[ab]{4}", t)),
        ({"structured_outputs": {"json": SCHEMA}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ],
)  # fmt: skip
def test_vllm_guided_fields(url, fields, valid):
    for _ in range(3):
        text, reason = _complete(url, **fields)
        assert reason == "stop" and valid(text), text


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"guided_json": {"type": "foo"}}, 'JSON schema cannot be used .*Unsupported type "foo"'),
        ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
        ({"guided_json": [1, 2]}, "guided_json must be a JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}, "minimum greater"),
        ({"response_format": {"type": "xml"}}, "response_format.type must be text"),
        ({"response_format": "json"}, "response_format must be an object"),
        ({"guided_regex": "(ab"}, "regular expression cannot be used .*not closed"),
        ({"guided_regex": ""}, "guided_regex must be a non-empty string"),
        ({"guided_grammar": "root ::= undefined_rule"}, "grammar cannot be used .*not defined"),
        ({"guided_choice": []}, "guided_choice must be a non-empty list"),
        ({"guided_choice": ["a", 1]}, "guided_choice must be a non-empty list"),
        ({"guided_regex": "a+", "guided_choice": ["a"]},
         r"one output constraint, but this one sets 2 \(guided_regex, guided_choice\)"),
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "sets 2"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "sets 2"),
        ({"structured_outputs": {"xml": "a"}}, "unknown key 'xml'"),
    ],
)  # fmt: skip
def test_bad_constraints_are_one_sentence_400s_and_the_server_keeps_serving(url, fields, message):
    assert re.search(message, _bad(url, **fields))
    text, reason = _complete(url, guided_choice=["ok"])
    assert (text, reason) == ("ok", "stop")


def test_speculation_keeps_greedy_guided_outputs():
    prompts = ["one two one two one two", "Paris Paris Paris Rome", "a b a b a b a"]

    def outputs(config) -> tuple[list[tuple[str, str]], str]:
        with running_server(config) as base:
            texts = [_complete(base, p, guided_json=SCHEMA, temperature=0) for p in prompts]
            texts += [
                _complete(base, p, guided_regex="(ab|cd){2,5}", temperature=0) for p in prompts
            ]
            return texts, _scrape(base)

    plain, _ = outputs(_config())
    speculated, metrics = outputs(_config(speculative_config=SPEC))
    assert speculated == plain
    drafted = _metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
    assert 0 < _metric(metrics, "vllm:spec_decode_num_accepted_tokens_total") < drafted
    for text, reason in plain[:3]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
