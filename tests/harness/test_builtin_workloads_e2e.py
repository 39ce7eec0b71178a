"""Every built-in workload, end to end against the managed reference engine (tiny-random), as
a new user runs them: a few requests each (multi-turn: a few sessions), all at once, zero
errors. `long-context` sends
3,072-5,120-token prompts, more than the engine's default step budget of 2,048 tokens."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from harness.run.config import RunConfig
from harness.run.orchestrator import run_benchmark
from harness.targets.target import target_for
from workloads.registry import builtin_names

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_target():
    with target_for(RunConfig(model="tiny-random", startup_timeout_s=180).server) as target:
        yield target


@pytest.mark.parametrize("workload", builtin_names())
def test_builtin_workload_runs_with_zero_errors(tiny_target, workload, tmp_path):
    config = RunConfig(
        model="tiny-random",
        workload=workload,
        num_requests=3,
        request_rate=float("inf"),
        out=tmp_path / "run",
        scrape_interval_s=0,
        timeout_s=300,
    )
    outcome = run_benchmark(config, target=tiny_target)
    assert outcome.complete
    requests = pq.read_table(tmp_path / "run" / "requests.parquet").to_pylist()
    sessions = {r["session_id"] for r in requests}
    if workload == "multi-turn":  # num_requests counts sessions, each of 2-4 turns
        assert len(sessions) == 3 and len(requests) >= 6
        assert outcome.summary.sessions.complete == 3
    else:
        assert len(requests) == 3 and sessions == {None}
    failures = [
        (r["status"], r["error_class"], r["error_message"]) for r in requests if r["status"] != "ok"
    ]
    assert failures == []
    for r in requests:
        assert r["output_tokens"] >= 1 and r["usage_prompt_tokens"] is not None
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["target"]["model"] == "tiny-random"
    if workload == "long-context":
        assert min(r["input_tokens"] for r in requests) > 2048


def test_a_deadline_reaches_the_engine_and_the_card(tiny_target, tmp_path):
    """A 1 ms deadline (x-request-deadline-ms) on 64-token answers: the engine ends each
    request with finish_reason deadline at its next step (every policy), and the summary
    counts them as dropped by the server, none met."""
    spec = tmp_path / "late.yaml"
    spec.write_text(
        "name: late\nnum_requests: 4\nignore_eos: true\ndeadline_ms: 1\n"
        "source: {kind: synthetic, input: {dist: fixed, value: 16}, "
        "output: {dist: fixed, value: 64}}\n"
    )
    config = RunConfig(model="tiny-random", workload=str(spec), request_rate=float("inf"),
                       out=tmp_path / "run", scrape_interval_s=0, timeout_s=300)  # fmt: skip
    outcome = run_benchmark(config, target=tiny_target)
    requests = pq.read_table(tmp_path / "run" / "requests.parquet").to_pylist()
    assert [r["deadline_ms"] for r in requests] == [1] * 4
    assert {(r["status"], r["finish_reason"]) for r in requests} == {("ok", "deadline")}
    assert all(r["output_tokens"] < 64 for r in requests)
    deadlines = outcome.summary.deadlines
    assert (deadlines.with_deadline, deadlines.met_deadline) == (4, 0)
    assert deadlines.dropped_by_server == 4
