"""Speculative decoding over HTTP on tiny-random: `--speculative-config` serves the same
greedy (and seeded) completions as a server without it, the request field `speculative`
opts out, /metrics carries vLLM's spec_decode counters; bad flags and fields are one
sentence."""

from __future__ import annotations

import json

import openai
import pytest
from click.testing import CliRunner
from server_fixtures import running_server
from test_server import _config, _metric, _scrape

from engine_ref.serving.cli_serve import serve

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                   "prompt_lookup_min": 1, "disable_by_batch_size": None})  # fmt: skip
PROMPTS = [
    "one two three four one two three four one two three",
    "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat",
    "a b c d e f g a b c d e f g a b c",
    "Hello world",
]


def _complete(url: str, prompt: str, **extra) -> tuple[str, list[int]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    with client:
        kwargs = {"temperature": 0, "max_tokens": 32, **extra}
        body = {"ignore_eos": True, "return_token_ids": True, **kwargs.pop("extra_body", {})}
        out = client.completions.create(
            model="tiny-random", prompt=prompt, extra_body=body, **kwargs
        )
        choice = out.choices[0]
        return choice.text, choice.model_extra.get("token_ids")


def _stream(url: str, prompt: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    with client:
        chunks = client.completions.create(
            model="tiny-random",
            prompt=prompt,
            temperature=0,
            max_tokens=32,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        texts = [c.choices[0].text for c in chunks if c.choices]
    return "".join(texts), len(texts)


@pytest.fixture(scope="module")
def plain_outputs():
    with running_server(_config()) as url:
        yield {
            "greedy": [_complete(url, p) for p in PROMPTS],
            "seeded": [_complete(url, p, temperature=1.0, seed=5) for p in PROMPTS],
            "stream": [_stream(url, p) for p in PROMPTS],
        }


def test_same_completions_with_speculation_and_metrics(plain_outputs):
    with running_server(_config(speculative_config=SPEC)) as url:
        assert [_complete(url, p) for p in PROMPTS] == plain_outputs["greedy"]
        seeded = [_complete(url, p, temperature=1.0, seed=5) for p in PROMPTS]
        assert seeded == plain_outputs["seeded"]
        streamed = [_stream(url, p) for p in PROMPTS]
        assert [t for t, _ in streamed] == [t for t, _ in plain_outputs["stream"]]
        # Chunks carry several tokens: fewer chunks than without speculation.
        assert sum(n for _, n in streamed) < sum(n for _, n in plain_outputs["stream"])
        text = _scrape(url)
        drafts = _metric(text, "vllm:spec_decode_num_drafts_total", model_name="tiny-random")
        tokens = _metric(text, "vllm:spec_decode_num_draft_tokens_total")
        accepted = _metric(text, "vllm:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted < tokens and drafts <= tokens <= 4 * drafts
        assert _metric(text, "vllm:spec_decode_acceptance_rate") == pytest.approx(accepted / tokens)
        length = _metric(text, "vllm:spec_decode_mean_accepted_length")
        assert length == pytest.approx(1 + accepted / drafts)
        first = _metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0")
        assert 0 < first <= drafts
        # Opting out: the counters stand still, the output is the same.
        before = _metric(_scrape(url), "vllm:spec_decode_num_drafts_total")
        off = _complete(url, PROMPTS[0], extra_body={"speculative": False})
        assert off == plain_outputs["greedy"][0]
        assert _metric(_scrape(url), "vllm:spec_decode_num_drafts_total") == before
        with pytest.raises(openai.BadRequestError, match="speculative must be true or false"):
            _complete(url, PROMPTS[0], extra_body={"speculative": "no"})
        assert _complete(url, PROMPTS[1]) == plain_outputs["greedy"][1]  # still serving


def test_no_spec_decode_metrics_without_speculation():
    with running_server(_config()) as url:
        assert "spec_decode" not in _scrape(url)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "--speculative-config is not valid JSON"),
        (
            '{"method": "medusa"}',
            "Unknown speculative method 'medusa'; use one of ngram, self_draft, draft_model.",
        ),
        ('{"num_speculative_tokens": -1}', "num_speculative_tokens must be at least 1"),
    ],
)
def test_bad_speculative_config_flag_is_one_sentence_and_exit_code_2(value, message):
    result = CliRunner().invoke(
        serve, ["--model", "tiny-random", "--speculative-config", value, "--port", "0"]
    )
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_speculative_config_flag_is_documented():
    result = CliRunner().invoke(serve, ["--help"])
    flat = "".join(result.output.split())
    assert "--speculative-config" in flat and "num_speculative_tokens" in flat
