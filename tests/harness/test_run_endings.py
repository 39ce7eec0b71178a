"""How `bench run` ends, through the command line: a wrong URL stops at the first 404, a managed
engine that dies mid-run is named, wrong outputs and a broken ledger fail the run's exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import bench
from harness.run.context import RunContext
from harness.run.outcome import OutputTally, judge
from slo.runrecord import (
    Ledger,
    OutcomeCounts,
    RequestRecord,
    RunSummary,
    RunWriter,
    SLOEvaluation,
    read_manifest,
)

FAST = ["--tokenizer", "tiny-random", "--workload", "random", "--input-len", "8", "--quiet"]


def bench_run(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "harness.cli", "run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)


def one_row_per_scheduled(run: Path) -> Counter:
    """The run's statuses, after checking every scheduled request has exactly one row."""
    scheduled = pq.read_table(run / "schedule.parquet").to_pydict()["request_id"]
    rows = pq.read_table(run / "requests.parquet").to_pydict()
    warm = pq.read_table(run / "warmup.parquet").to_pydict()["request_id"]
    assert Counter(rows["request_id"] + warm) == Counter(scheduled)
    return Counter(rows["status"])


@pytest.mark.slow  # starts a mock server
def test_a_first_request_answered_404_stops_the_run_at_once(mock_server, tmp_path):
    """A wrong path at 2 requests/s would run 500 s; the first answer (404) ends it, exit 3,
    with the sentence naming the URL tried, and the other 999 requests are `not_sent`."""
    run = tmp_path / "run"
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        root = url.removesuffix("/v1")
        start = time.monotonic()
        result = bench_run("--url", f"{root}/wrong/v1", "--model", "mock", *FAST,
                           "--output-len", "2", "--request-rate", "2", "--num-requests", "1000",
                           "--out", str(run), timeout_s=120)  # fmt: skip
        elapsed_s = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert elapsed_s < 60, elapsed_s
    assert f"got HTTP 404 from POST {root}/wrong/v1/completions" in result.stderr
    assert "Traceback" not in output
    statuses = one_row_per_scheduled(run)
    assert sum(statuses.values()) == 1000
    assert statuses["error"] >= 1 and statuses["not_sent"] >= 990, statuses
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is False and "404" in manifest["interrupted_reason"]
    assert manifest["outcome"]["exit_code"] == 3


@pytest.mark.slow  # starts the reference engine
def test_a_model_the_server_does_not_serve_stops_at_the_first_404(tmp_path):
    """The reference server answers 404 for a model it does not serve, as vLLM does."""
    from harness.targets.managed import ManagedServerConfig, managed_server

    run = tmp_path / "run"
    with managed_server(ManagedServerConfig(model="tiny-random", startup_timeout_s=120)) as server:
        result = bench_run("--url", server.base_url, "--model", "gpt-4", *FAST, "--output-len",
                           "2", "--request-rate", "2", "--num-requests", "200", "--out", str(run),
                           timeout_s=120)  # fmt: skip
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"got HTTP 404 from POST {server.base_url}/completions" in result.stderr
    assert "the target serves the model asked for (--model)" in result.stderr
    statuses = one_row_per_scheduled(run)
    assert sum(statuses.values()) == 200 and statuses["not_sent"] >= 190, statuses


DYING_ENGINE = Path(__file__).parent / "dying_engine.py"


@pytest.fixture
def fresh_cache(private_cache):
    """The managed vllm's export of tiny-random lands in a cache of this test's own (two tests
    exporting into one cache at once would race)."""
    return private_cache


@pytest.mark.slow  # starts an engine process
@pytest.mark.parametrize(("die", "named"), [("segv", "SIGSEGV"), ("exit1", "code 1")])
def test_a_managed_engine_that_dies_mid_run_is_named_and_stops_the_run(
    tmp_path, fresh_cache, die, named
):
    """The engine starts, passes startup and preflight, then dies on the first completion
    request: the run stops at once (exit 3) and says how and when it died, with the end of
    its log, on the console, in the manifest and on the card; one row per scheduled request."""
    run = tmp_path / "run"
    engine = (f"vllm={{python}} {DYING_ENGINE} --port {{port}} --model {{served_model}} "
              f"--die {die}")  # fmt: skip
    start = time.monotonic()
    result = bench_run("--target", "vllm", "--engine-command", engine, "--model", "tiny-random",
                       "--workload", "random", "--input-len", "8", "--output-len", "4",
                       "--request-rate", "2", "--num-requests", "200", "--out", str(run),
                       "--quiet", timeout_s=180)  # fmt: skip
    elapsed_s = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert elapsed_s < 90, elapsed_s  # 200 requests at 2/s would take 100 s
    assert "Traceback" not in output
    said = f"the managed vllm exited with {named}"
    assert said in result.stderr and "s into the run; last lines of server.log:" in result.stderr
    assert f"dying by {die}" in result.stderr  # the last line the engine wrote to its log
    statuses = one_row_per_scheduled(run)
    assert sum(statuses.values()) == 200 and statuses["not_sent"] >= 190, statuses
    manifest = json.loads((run / "manifest.json").read_text())
    assert said in manifest["interrupted_reason"] and manifest["outcome"]["exit_code"] == 3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["run_complete"] is False and said in summary["run_stop_reason"]
    assert (summary["ledger"]["lost"], summary["ledger"]["unexpected"]) == (0, 0)
    card = tmp_path / "card.json"
    shown = subprocess.run([sys.executable, "-m", "harness.cli", "report", str(run), "--json",
                            str(card)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert any(said in note for note in json.loads(card.read_text())["notes"])


@pytest.mark.slow  # starts a mock server
def test_wrong_outputs_fail_a_check_outputs_run(mock_server, tmp_path):
    """The mock writes ` t0 t1 ...`, not what tiny-random would: every output diverges from
    the reference's at its first token, so `--check-outputs` fails the run (exit 1)."""
    run = tmp_path / "run"
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        result = bench_run("--url", url, *FAST, "--output-len", "4", "--request-rate", "inf",
                           "--num-requests", "8", "--check-outputs", "--out", str(run))  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "8 of 8 outputs checked are wrong output (diverged 8)." in result.stderr
    rows = pq.read_table(run / "requests.parquet").to_pylist()
    assert [(r["status"], r["output_valid"]) for r in rows] == [("ok", False)] * 8
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["outcome"]["exit_code"] == 1


@pytest.mark.slow  # starts the reference engine
def test_the_reference_engine_checked_against_itself_passes(tmp_path):
    """Negative control: the managed tiny-random engine's greedy outputs are the oracle's."""
    run = tmp_path / "run"
    result = bench_run("--model", "tiny-random", "--workload", "random", "--input-len", "8",
                       "--output-len", "8", "--request-rate", "inf", "--num-requests", "4",
                       "--check-outputs", "--out", str(run), "--quiet")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "wrong output" not in result.stderr
    correctness = json.loads((run / "summary.json").read_text())["correctness"]
    assert (correctness["n_compared"], correctness["n_wrong"]) == (4, 0), correctness
    rows = pq.read_table(run / "requests.parquet").to_pylist()
    assert [(r["status"], r["output_valid"]) for r in rows] == [("ok", True)] * 4


@pytest.mark.slow  # starts a mock server
def test_an_inconclusive_slo_exits_3_and_a_conclusive_one_0(mock_server, tmp_path):
    """p99 asks for 100 samples; 3 requests cannot judge it: exit 3, as `bench compare
    --gate` does. A median that 12 samples can judge passes: exit 0."""
    judged = tmp_path / "judged.yaml"
    judged.write_text(
        "name: judged\npercentiles:\n  - {metric: ttft_ms, percentile: 50, max_ms: 60000}\n"
    )
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        common = ["--url", url, *FAST, "--output-len", "2", "--request-rate", "inf"]
        few = bench_run(*common, "--num-requests", "3", "--slo", "p99",
                        "--out", str(tmp_path / "few"))  # fmt: skip
        ok = bench_run(*common, "--num-requests", "12", "--slo", str(judged),
                       "--out", str(tmp_path / "ok"))  # fmt: skip
    assert few.returncode == 3, few.stdout + few.stderr
    assert "The SLO verdict is inconclusive (4 of 4 objectives could not be judged" in few.stderr
    assert "fewer than min_samples 100" in few.stderr
    assert json.loads((tmp_path / "few" / "manifest.json").read_text())["complete"] is True
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["slo"]["verdict"] == "pass"


def _objective(verdict: str) -> dict:
    return {"name": "ttft_ms p99 <= 500 ms", "verdict": verdict, "reason": "3 samples"}


@pytest.mark.parametrize(
    ("slo", "outputs", "exit_code", "says"),
    [
        ({"verdict": "pass", "objectives": [_objective("pass")]}, None, 0, None),
        (
            {"verdict": "inconclusive", "objectives": [_objective("inconclusive")]},
            None,
            3,
            "The SLO verdict is inconclusive (1 of 1 objectives could not be judged",
        ),
        # a definite failure outranks an inconclusive verdict, as a regression does in the gate
        (
            {"verdict": "inconclusive", "objectives": [_objective("inconclusive")]},
            OutputTally(4, 1, {"diverged": 1}),
            1,
            "1 of 4 outputs checked are wrong output",
        ),
        (
            {"verdict": "fail", "objectives": [_objective("fail")]},
            OutputTally(4, 0, {}),
            1,
            "The run missed its SLO.",
        ),
        # per-request limits only (vLLM's --goodput): no objective, nothing to judge
        ({"verdict": "inconclusive", "objectives": []}, None, 0, None),
        (
            None,
            OutputTally(8, 8, {"diverged": 8}),
            1,
            "8 of 8 outputs checked are wrong output (diverged 8).",
        ),
    ],
)
def test_judge_ranks_a_miss_above_inconclusive(slo, outputs, exit_code, says):
    summary = RunSummary(
        counts=OutcomeCounts(total=4, by_status={"ok": 4}), slo=SLOEvaluation.from_dict(slo)
    )
    verdict = judge(summary, stopped_reason=None, stopped_by_errors=False,
                    slo_given=slo is not None, outputs=outputs)  # fmt: skip
    assert verdict.exit_code == exit_code
    assert (verdict.sentence is None) if says is None else (says in verdict.sentence)


@pytest.mark.parametrize(
    ("stopped_reason", "by_errors", "exit_code", "also"),
    [
        (None, False, 4, None),
        ("5 requests in a row failed", True, 4, "The run was stopped early: 5 requests"),
        ("interrupted by SIGINT", False, 130, None),  # the user's Ctrl-C keeps its code
    ],
)
def test_a_ledger_that_does_not_balance_is_exit_4_whatever_else(
    stopped_reason, by_errors, exit_code, also
):
    summary = RunSummary(
        counts=OutcomeCounts(total=3, by_status={"ok": 3}),
        ledger=Ledger(lost=1, lost_ids=["r2"], unexpected=0, verdict="failed"),
    )
    verdict = judge(summary, stopped_reason=stopped_reason, stopped_by_errors=by_errors,
                    slo_given=False)  # fmt: skip
    assert verdict.exit_code == exit_code
    assert verdict.sentence.startswith(
        "The ledger does not balance: 1 scheduled requests have no row (r2) and 0 rows are"
    )
    assert also is None or also in verdict.sentence


@pytest.mark.slow  # starts a mock server
@pytest.mark.parametrize(("defect", "lost", "unexpected"), [("drop", 1, 0), ("twice", 0, 1)])
def test_a_run_whose_ledger_does_not_balance_exits_4(
    mock_server, tmp_path, monkeypatch, defect, lost, unexpected
):
    """A harness defect, injected: the first measured result is never recorded, or recorded
    twice. `bench run` says the ledger does not balance and exits 4; `bench report` shows it."""
    record = RunContext.on_result
    done: list[str] = []

    def defective(self, raw):
        first = not raw.is_warmup and not done
        done.append(raw.request_id)
        if not (first and defect == "drop"):
            record(self, raw)
        if first and defect == "twice":
            self.recorder.add(raw)

    monkeypatch.setattr(RunContext, "on_result", defective)
    run = tmp_path / "run"
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        result = CliRunner().invoke(bench, ["run", "--url", url, *FAST, "--output-len", "2",
                                            "--request-rate", "inf", "--num-requests", "6",
                                            "--out", str(run)])  # fmt: skip
    assert result.exit_code == 4, result.output
    said = f"The ledger does not balance: {lost} scheduled requests have no row"
    assert said in result.output and f"and {unexpected} rows are unexpected" in result.output
    assert json.loads((run / "manifest.json").read_text())["outcome"]["exit_code"] == 4
    monkeypatch.undo()
    shown = CliRunner().invoke(bench, ["report", str(run)])
    assert shown.exit_code == 0, shown.output
    assert f"ledger failed: 6 scheduled, lost = {lost}, unexpected = {unexpected}" in shown.output


def rewrite_run(run: Path, out: Path, *, drop: int = 0, extra: tuple[str, ...] = ()) -> Path:
    """`run` written again into `out` by the production writer, without its first `drop`
    request rows and with an ok row for each id in `extra` (scheduled or not)."""
    out.mkdir()
    writer = RunWriter(out, read_manifest(run))
    schedule = pq.read_table(run / "schedule.parquet").to_pylist()
    writer.write_schedule([(r["request_id"], r["arrival_s"], r["is_warmup"]) for r in schedule])
    rows = pq.read_table(run / "requests.parquet").to_pylist()[drop:]
    writer.append_requests([RequestRecord(**r) for r in rows])
    writer.append_requests([RequestRecord(rid, status="ok", t_sent_ns=0, t_done_ns=1)
                            for rid in extra])  # fmt: skip
    chunks = pq.read_table(run / "chunks.parquet").to_pylist()
    writer.append_chunks([tuple(c.values()) for c in chunks])
    manifest = read_manifest(run)
    writer.close(complete=manifest.complete, reason=manifest.interrupted_reason)
    return out


@pytest.mark.slow  # starts a mock server
@pytest.mark.parametrize(
    ("drop", "extra", "lost", "unexpected"),
    [(1, (), 1, 0), (0, ("stray-1",), 0, 1), (0, ("DUP",), 0, 1)],
)
def test_bench_report_shows_a_row_lost_or_invented(mock_server, tmp_path, drop, extra, lost,
                                                   unexpected):  # fmt: skip
    """A run recorded normally, then written again by the production writer without one of
    its rows, with a row for no scheduled request, or with a second row for one:
    `bench report` re-summarises it and its console and JSON cards show the ledger failed."""
    run = tmp_path / "run"
    with mock_server("--ttft-ms", "1", "--itl-ms", "1") as url:
        result = CliRunner().invoke(bench, ["run", "--url", url, *FAST, "--output-len", "2",
                                            "--request-rate", "inf", "--num-requests", "5",
                                            "--out", str(run), "--quiet"])  # fmt: skip
    assert result.exit_code == 0, result.output
    first = pq.read_table(run / "requests.parquet").to_pylist()[0]["request_id"]
    extra = tuple(first if rid == "DUP" else rid for rid in extra)
    changed = rewrite_run(run, tmp_path / "changed", drop=drop, extra=extra)
    card = tmp_path / "card.json"
    shown = CliRunner().invoke(bench, ["report", str(changed), "--json", str(card)])
    assert shown.exit_code == 0, shown.output
    assert f"ledger failed: 5 scheduled, lost = {lost}, unexpected = {unexpected}" in shown.output
    ledger = json.loads(card.read_text())["ledger"]
    assert (ledger["lost"], ledger["unexpected"], ledger["verdict"]) == (lost, unexpected, "failed")
    assert ledger["lost_ids"] == ([first] if lost else [])
