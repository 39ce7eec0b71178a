"""`--reasoning-parser think` (`engine_ref.serving.reasoning`): the chat endpoint streams a
`<think>` span as `reasoning_content`, holds a tag cut across tokens back until decided, and
counts the tokens up to `</think>` in `usage.completion_tokens_details`; without the flag, and
on the completions endpoint, nothing changes."""

from __future__ import annotations

import json
import urllib.request

import pytest
from click.testing import CliRunner
from server_fixtures import running_server

from engine_ref.serving.cli_serve import serve
from engine_ref.serving.endpoints import ENDPOINTS
from engine_ref.serving.interface import EngineConfig
from engine_ref.serving.reasoning import ReasoningChatEndpoint, with_reasoning
from engine_ref.serving.server import ServerConfig, ServerError

REGEX = "<think>[a-z]{5,9}</think>[a-z]{3,6}"


def _deltas(tokens: list[str], *, finish_at_end: bool = True) -> tuple[list[dict], dict]:
    """Feed `tokens` one engine output each to a reasoning chat choice; the rendered deltas
    and the final usage details."""
    endpoint = ReasoningChatEndpoint()
    choice = endpoint.new_choice(0, keep_history=False)
    rendered = []
    for i, token in enumerate(tokens, 1):
        finish = "stop" if finish_at_end and i == len(tokens) else None
        choice.add(token, [i], [], finish, i)
        rendered.append(endpoint.delta(choice.take_pending(), with_logprobs=False)["delta"])
    usage = endpoint.usage_details({"completion_tokens": len(tokens)}, [choice])
    return rendered, usage["completion_tokens_details"]


def test_tags_cut_across_tokens_are_held_back_and_counted_as_reasoning():
    rendered, details = _deltas(["<th", "ink>", "ab", "</", "think>", "c", "d"])
    assert rendered == [
        {"reasoning_content": ""},  # `<th` may open the span: held, its token reasoning
        {"reasoning_content": ""},  # `<think>` complete: no text
        {"reasoning_content": "ab"},
        {"reasoning_content": ""},  # `</` held back
        {"reasoning_content": ""},  # `</think>`: the last reasoning token
        {"content": "c"},
        {"content": "d"},
    ]
    assert details == {"reasoning_tokens": 5}


@pytest.mark.parametrize(
    ("tokens", "deltas", "reasoning_tokens"),
    [
        (["<think>", "ab"], [{"reasoning_content": ""}, {"reasoning_content": "ab"}], 2),  # open
        (["<think>", "</think>", "x"], [{"reasoning_content": ""}] * 2 + [{"content": "x"}], 2),
        (
            ["hi", "<think>x</think>y"],
            [{"content": "hi"}, {"reasoning_content": "x", "content": "y"}],
            2,
        ),  # fmt: skip
        (["a<", "b"], [{"content": "a"}, {"content": "<b"}], 0),  # `<` held, then text
        (["no", " tags"], [{"content": "no"}, {"content": " tags"}], 0),
    ],
)
def test_reasoning_parser_table(tokens, deltas, reasoning_tokens):
    rendered, details = _deltas(tokens)
    assert rendered == deltas
    assert details == {"reasoning_tokens": reasoning_tokens}


def test_a_partial_tag_at_the_end_is_flushed_as_text():
    rendered, _ = _deltas(["<think>", "x</thi"])
    assert rendered[-1] == {"reasoning_content": "x</thi"}


def test_without_the_flag_the_endpoints_are_unchanged():
    for endpoint in ENDPOINTS.values():
        assert with_reasoning(endpoint, None) is endpoint
    assert with_reasoning(ENDPOINTS["completion"], "think") is ENDPOINTS["completion"]
    assert isinstance(with_reasoning(ENDPOINTS["chat"], "think"), ReasoningChatEndpoint)
    with pytest.raises(ServerError, match="Unknown reasoning parser 'deepseek'"):
        ServerConfig(reasoning_parser="deepseek")
    result = CliRunner().invoke(serve, ["--reasoning-parser", "deepseek"])
    assert result.exit_code == 2 and "'deepseek' is not 'think'" in result.output


def _post(url: str, path: str, body: dict) -> bytes:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return answer.read()


def _events(raw: bytes) -> list[dict]:
    lines = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


@pytest.fixture(scope="module")
def server():
    """tiny-random with the parser (without it: `tests/harness/test_reasoning_e2e.py`)."""
    from engine_ref.core.grammar import grammar_available

    if not grammar_available():
        pytest.skip("xgrammar is not installed (pip install 'llm-bench-harness[grammar]')")
    engine = EngineConfig(model="tiny-random")
    with running_server(ServerConfig(engine=engine, port=0, reasoning_parser="think")) as url:
        yield url


def _chat(stream: bool) -> dict:
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 48, "structured_outputs": {"regex": REGEX}, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def test_the_chat_stream_carries_reasoning_apart_and_counts_it(server):
    on = server
    events = _events(_post(on, "/v1/chat/completions", _chat(stream=True)))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    answer = "".join(d.get("content") or "" for d in deltas)
    assert 5 <= len(reasoning) <= 9 and reasoning.isalpha()
    assert 3 <= len(answer) <= 6 and answer.isalpha()
    # tokens of the chunks that carry the reasoning key add up to the usage's count
    usage = [e["usage"]["completion_tokens"] for e in events]
    grown = [b - a for a, b in zip([0, *usage], usage, strict=False)]
    marked = sum(
        n for n, e in zip(grown, events, strict=True)
        if e["choices"] and "reasoning_content" in e["choices"][0]["delta"]
    )  # fmt: skip
    assert marked == events[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert 7 + 1 <= marked < events[-1]["usage"]["completion_tokens"]


def test_a_whole_answer_and_the_completions_endpoint(server):
    on = server
    body = json.loads(_post(on, "/v1/chat/completions", _chat(stream=False)))
    message = body["choices"][0]["message"]
    assert "<" not in message["content"] and message["reasoning_content"].isalpha()
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 7 + 1
    completion = {"model": "tiny-random", "prompt": "hi", "max_tokens": 48,
                  "structured_outputs": {"regex": REGEX}}  # fmt: skip
    text = json.loads(_post(on, "/v1/completions", completion))["choices"][0]["text"]
    assert text.startswith("<think>") and "</think>" in text  # unchanged: the raw output
