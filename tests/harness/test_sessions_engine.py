"""Multi-turn sessions against the reference engine (tiny-random, managed, with
`usage.prompt_tokens_details`): turn k+1's prompt starts with turn k's prompt and the answer the
engine generated, token for token, and the cached prompt tokens it reports grow turn by turn."""

from __future__ import annotations

import json
import subprocess
import sys

import orjson
import pyarrow.parquet as pq
import pytest

from harness.http.client import ClientOptions, make_session, send
from harness.http.sse import split_events
from harness.http.transport import BaseTransport
from harness.run.config import RunConfig
from harness.run.orchestrator import run_benchmark
from harness.targets.target import target_for
from slo.runrecord import Endpoint

pytestmark = pytest.mark.slow  # a managed tiny-random engine process serves the whole module

SPEC = """\
name: sessions-test
num_requests: 3
seed: 1
ignore_eos: true
source:
  kind: sessions
  turns: {dist: uniform, low: 3, high: 4}
  input: {dist: uniform, low: 20, high: 40}
  output: {dist: uniform, low: 6, high: 12}
  think_ms: {dist: uniform, low: 1, high: 5}
arrivals: {process: poisson, rate: 20}
"""


@pytest.fixture(scope="module")
def tiny_target():
    with target_for(RunConfig(model="tiny-random", startup_timeout_s=180).server) as target:
        yield target


class RecordingTransport(BaseTransport):
    """The real client path (`harness.http.client.send`), one short-lived session per request,
    keeping every body sent and every raw result."""

    def __init__(self, options) -> None:
        self.options = options
        self.sent: dict[str, tuple[dict, object]] = {}

    async def handle_request(self, payload, result) -> None:
        async with make_session(self.options, max_connections=1) as session:
            await send(session, self.options, payload, result)
        self.sent[payload.request_id] = (orjson.loads(payload.body), result)


def _generated_ids(result) -> list[int]:
    events, _, _ = split_events(result.reads)
    ids: list[int] = []
    for _, data in events:
        if data != b"[DONE]":
            for choice in orjson.loads(data).get("choices") or []:
                ids += choice.get("token_ids") or []
    return ids


def _by_session(run_dir):
    rows = pq.read_table(run_dir / "requests.parquet").to_pylist()
    sessions: dict[str, list[dict]] = {}
    for r in rows:
        sessions.setdefault(r["session_id"], []).append(r)
    return {k: sorted(v, key=lambda r: r["turn_index"]) for k, v in sessions.items()}


def test_completions_turns_extend_prompt_and_answer_token_for_token(
    tiny_target, tmp_path, private_cache
):
    """The recording transport sends through the real client path and keeps each body (the
    token-id prompt the server takes verbatim) and each stream (whose `token_ids` are the
    server's report of the tokens it generated)."""
    spec = tmp_path / "sessions.yaml"
    spec.write_text(SPEC)
    config = RunConfig(
        model="tiny-random",
        workload=str(spec),
        endpoint="completions",
        out=tmp_path / "run",
        scrape_interval_s=0,
        settle_s=0,
    )
    options = ClientOptions(
        base_url=tiny_target.base_url, model="tiny-random", endpoint=Endpoint.COMPLETIONS
    )
    transport = RecordingTransport(options)
    outcome = run_benchmark(config, target=tiny_target, transport=transport)
    assert outcome.complete and outcome.summary.ledger.verdict == "ok"
    sent = transport.sent
    sessions = _by_session(tmp_path / "run")
    assert len(sessions) == 3
    for turns in sessions.values():
        assert [r["status"] for r in turns] == ["ok"] * len(turns) and len(turns) >= 3
        for prev, turn in zip(turns, turns[1:], strict=False):
            prev_prompt = sent[prev["request_id"]][0]["prompt"]
            answer = _generated_ids(sent[prev["request_id"]][1])
            assert len(answer) == prev["output_tokens"]  # the server's echo of what it generated
            prompt = sent[turn["request_id"]][0]["prompt"]
            assert prompt[: len(prev_prompt) + len(answer)] == prev_prompt + answer
            assert turn["usage_prompt_tokens"] == len(prompt)  # the ids the server saw
        cached = [r["usage_cached_tokens"] for r in turns]
        assert all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached
    by_turn = outcome.summary.sessions.by_turn
    assert [t.turn for t in by_turn][:3] == [0, 1, 2]
    rates = [t.cache_hit_rate for t in by_turn[:3]]
    assert rates[0] < rates[1] < rates[2]


def test_chat_sessions_through_bench_run(tiny_target, tmp_path, private_cache):
    spec = tmp_path / "sessions.yaml"
    spec.write_text(SPEC)
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "harness.cli", "run", "--url", tiny_target.base_url,
        "--tokenizer", "tiny-random", "--workload", str(spec), "--endpoint", "chat",
        "--session-header", "x-session-id", "--out", str(out), "--quiet",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ledger"]["verdict"] == "ok"
    assert summary["sessions"]["sessions"] == 3 and summary["sessions"]["complete"] == 3
    assert summary["prompt_tokens"]["sentence"] is None  # later turns' history is expected
    # a chat history re-encodes the answer text, exact only as far as the text re-encodes to
    # the sampled tokens (random tiny-random tokens often do not): hits grow, not block for block
    for turns in _by_session(out).values():
        prompts = [r["usage_prompt_tokens"] for r in turns]
        cached = [r["usage_cached_tokens"] for r in turns]
        assert all(b > a for a, b in zip(prompts, prompts[1:], strict=False))
        assert all(b >= a for a, b in zip(cached, cached[1:], strict=False)), cached
    by_turn = summary["sessions"]["by_turn"][:3]
    assert [t["turn"] for t in by_turn] == [0, 1, 2]
    means = [t["cached_tokens_mean"] for t in by_turn]
    assert means[0] < means[1] < means[2], means
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["session_header"] == "x-session-id"
