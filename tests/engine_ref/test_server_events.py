"""The reference server's Responses (`/v1/responses`) and Messages (`/v1/messages`) APIs on
tiny-random: the event sequences and field names (Responses events checked by the `openai`
package's own models), usage against the prompt's chat-template tokens, stop reasons, errors in
each API's shape, the API key as `x-api-key`; then `bench run` through both (every request ok,
usage agreeing with what streamed) and the bad-input probe's cases for both routes."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pyarrow.parquet as pq
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from server_fixtures import running_server

from engine_ref.core.engine_config import EngineConfig
from engine_ref.loading.tiny_random import build_tiny_tokenizer
from engine_ref.serving.server import ServerConfig
from faults.probe import ProbeConfig, run_probe
from faults.probe_cases.case import Category
from faults.probe_report import Verdict
from harness.run.config import RunConfig
from harness.run.orchestrator import run_benchmark

MODEL = "tiny-random"
KEY = "sekret"
PROMPT = "Hello there"


@pytest.fixture(scope="module")
def url():
    engine = EngineConfig(model=MODEL, dtype="float32", device="cpu", num_threads=1,
                          kv_cache_memory_bytes=512 * 16 * 1024)  # fmt: skip
    with running_server(ServerConfig(engine=engine, port=0, api_key=KEY)) as base:
        yield base


def _post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
               **(headers or {})}  # fmt: skip
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _events(raw: bytes) -> list[dict]:
    """Each event's data, after checking its `event:` line names its `type`."""
    events = []
    for block in raw.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def _prompt_tokens() -> int:
    """The prompt's tokens as the server renders it: the chat template around one user turn."""
    tokenizer = build_tiny_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    return len(tokenizer.encode(text))


def test_a_streamed_response_has_the_apis_events_and_usage(url):
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 4, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    status, raw = _post(url, "/v1/responses", body)
    assert status == 200
    events = _events(raw)
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:  # the openai package's models: field names and types
        adapter.validate_python(event)
    kinds = [e["type"] for e in events]
    n_deltas = kinds.count("response.output_text.delta")
    assert 1 <= n_deltas <= 4
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * n_deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",  # the output bound ended it
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-4]["text"] == text
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == text
    usage = final["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (_prompt_tokens(), 4)
    assert usage["total_tokens"] == _prompt_tokens() + 4
    # the same greedy request, whole: a valid `response` with the same text
    status, whole = _post(url, "/v1/responses", {**body, "stream": False})
    assert status == 200
    response = Response.model_validate(json.loads(whole))
    assert response.output_text == text and response.usage.output_tokens == 4


def test_a_streamed_message_has_the_apis_events_and_usage(url):
    body = {"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 3, "stream": True, "ignore_eos": True, "temperature": 0}  # fmt: skip
    status, raw = _post(url, "/v1/messages", body, {"anthropic-version": "2023-06-01"})
    assert status == 200
    events = _events(raw)
    kinds = [e["type"] for e in events]
    n_deltas = kinds.count("content_block_delta")
    assert 1 <= n_deltas <= 3
    assert kinds == ["message_start", "content_block_start", "ping",
                     *["content_block_delta"] * n_deltas, "content_block_stop", "message_delta",
                     "message_stop"]  # fmt: skip
    tokenizer = build_tiny_tokenizer()
    template = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
    )
    start = events[0]["message"]
    assert (
        start["role"] == "assistant" and start["content"] == [] and start["id"].startswith("msg_")
    )
    assert start["usage"]["input_tokens"] == len(tokenizer.encode(template))
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert all(
        e["delta"]["type"] == "text_delta" for e in events if e["type"] == "content_block_delta"
    )
    delta = events[-2]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    status, whole = _post(url, "/v1/messages", {**body, "stream": False})
    message = json.loads(whole)
    assert status == 200 and message["type"] == "message" and message["stop_reason"] == "max_tokens"
    assert message["content"] == [{"type": "text", "text": text}]
    assert message["usage"]["output_tokens"] == 3


def test_the_key_may_come_as_x_api_key(url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    headers = {"Authorization": "", "x-api-key": KEY}
    assert _post(url, "/v1/messages", body, headers)[0] == 200
    assert _post(url, "/v1/messages", body, {"Authorization": "", "x-api-key": "wrong"})[0] == 401


@pytest.mark.parametrize(
    ("path", "body", "status", "answer"),
    [
        ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}]}, 400,
         {"type": "error", "error": {"type": "invalid_request_error",
                                     "message": "max_tokens is required."}}),
        ("/v1/messages", {"model": "nope", "messages": [{"role": "user", "content": "Hi"}],
                          "max_tokens": 2}, 404,
         {"type": "error", "error": {"type": "not_found_error", "message":
                                     "The model 'nope' does not exist; this server serves 'tiny-random'."}}),
        ("/v1/responses", {"max_output_tokens": 2}, 400,
         {"error": {"message": "input is required.", "type": "invalid_request_error",
                    "param": "input", "code": None}}),
        ("/v1/responses", {"input": "Hi", "previous_response_id": "resp_1"}, 400,
         {"error": {"message": "previous_response_id is not supported: this server stores no "
                               "responses; send the whole conversation as input.",
                    "type": "invalid_request_error", "param": "previous_response_id",
                    "code": None}}),
    ],
)  # fmt: skip
def test_errors_come_in_each_apis_shape(url, path, body, status, answer):
    got_status, raw = _post(url, path, body)
    assert (got_status, json.loads(raw)) == (status, answer)


@pytest.mark.parametrize("endpoint", ["responses", "messages"])
def test_bench_run_through_each_api_is_all_ok_with_usage_matching_the_stream(
    url, endpoint, tmp_path
):
    config = RunConfig(url=url + "/v1", model=MODEL, api_key=KEY, endpoint=endpoint,
                       tokenizer=MODEL, workload="random", input_len=8, output_len=6,
                       num_requests=6, concurrency=3, out=tmp_path / "run")  # fmt: skip
    outcome = run_benchmark(config)
    assert outcome.complete
    req = pq.read_table(tmp_path / "run" / "requests.parquet").to_pydict()
    assert req["status"] == ["ok"] * 6
    assert req["usage_completion_tokens"] == [6] * 6 == req["output_tokens"]
    assert req["client_output_tokens"] == [6] * 6  # the streamed text, retokenised
    assert req["output_flags"] == [None] * 6
    assert all(p > i for p, i in zip(req["usage_prompt_tokens"], req["input_tokens"], strict=True))
    finish = "max_output_tokens" if endpoint == "responses" else "max_tokens"
    assert req["finish_reason"] == [finish] * 6


def test_the_bad_input_probe_passes_every_case_of_both_routes(url):
    config = ProbeConfig(url=url, api_key=KEY, only=frozenset({Category.EVENT_APIS}),
                         num_streams=1, timeout_s=30)  # fmt: skip
    report = asyncio.run(run_probe(config))
    assert len(report.results) == 19
    assert {r.verdict for r in report.results} == {Verdict.PASS}, [
        (r.name, r.reason) for r in report.results if r.verdict is not Verdict.PASS
    ]
    assert report.passed
