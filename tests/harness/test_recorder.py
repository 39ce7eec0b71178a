"""The run recorder: raw results from `FakeTransport` through `to_rows` and `RunRecorder` to the
run directory, read back with `slo.runrecord.open_run`; flushes, close, warm-up and a crash."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pyarrow.parquet as pq
import pytest
from fake_transport import (
    Body,
    ConnectFailure,
    FakeTransport,
    HttpError,
    Outcome,
    Stream,
    completion_body,
    sse_event,
    stream,
    usage,
)

from harness.http.client import RawResult, RequestPayload
from harness.load.loadgen import LoadPlan, run_load
from harness.load.recorder import RunRecorder
from harness.load.records import RecordContext
from slo.runrecord import (
    ErrorClass,
    RequestStatus,
    RunManifest,
    TokenSource,
    open_run,
    read_manifest,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HANG = Stream([], first_byte_s=30.0)


class Case(NamedTuple):
    """One scripted outcome and the row it must become. `plain` is `(output_tokens_source,
    output_tokens)` without a tokenizer, `tokenized` with one counting a token per character."""

    outcome: Outcome
    status: RequestStatus
    error_class: ErrorClass | None
    http_status: int | None
    plain: tuple[TokenSource, int]
    tokenized: tuple[TokenSource, int]
    chunk_rows: int = 0


S, E, T = RequestStatus, ErrorClass, TokenSource
NONE = (T.CHUNK_COUNT, 0)
CASES = {
    "usage": Case(stream(["a", "b", "c"], usage=usage(2, 5)), S.OK, None, 200, (T.USAGE, 5), (T.USAGE, 5), 4),
    "no-usage": Case(stream(["ab", "cde"]), S.OK, None, 200, (T.CHUNK_COUNT, 2), (T.TOKENIZER, 5), 2),
    "body": Case(Body(completion_body("hello", usage=usage(2, 4))), S.OK, None, 200, (T.USAGE, 4), (T.USAGE, 4), 1),
    "500": Case(HttpError(500, "boom"), S.ERROR, E.HTTP_5XX, 500, NONE, NONE),
    "429": Case(HttpError(429, "slow down"), S.REJECTED, E.REJECTED_429, 429, NONE, NONE),
    "404": Case(HttpError(404, "no such model"), S.ERROR, E.HTTP_4XX, 404, NONE, NONE),
    "refused": Case(ConnectFailure(), S.ERROR, E.CONNECTION_REFUSED, None, NONE, NONE),
    "reset": Case(
        stream(["xy", "z"], done=False, fail_with=E.CONNECTION_RESET),
        S.UNKNOWN, E.CONNECTION_RESET, 200, (T.CHUNK_COUNT, 2), (T.TOKENIZER, 3), 2,
    ),
    "incomplete": Case(stream(["abc"], done=False), S.UNKNOWN, E.INCOMPLETE_STREAM, 200, (T.CHUNK_COUNT, 1), (T.TOKENIZER, 3), 1),
    "stream-error": Case(
        Stream([(0.0, sse_event({"error": {"message": "out of memory"}}))]),
        S.ERROR, E.STREAM_ERROR, 200, NONE, NONE,
    ),
    "timeout": Case(HANG, S.TIMEOUT, E.TIMEOUT, None, NONE, NONE),
}  # fmt: skip


def _one_token_per_char(text: str) -> int:
    return len(text)


async def _results(
    script, ids: list[str], *, warmup: tuple[str, ...] = (), timeout_s: float | None = None
) -> tuple[list[RawResult], int]:
    """Send `ids` at offsets 0, 1, 2, … ms (warm-up first); return the results and t0."""
    transport = FakeTransport(script, timeout_s=timeout_s)
    payloads = [RequestPayload(rid, b"{}") for rid in ids]
    plan = LoadPlan(
        payloads,
        [i / 1000 for i in range(len(ids))],
        warmup=[RequestPayload(rid, b"{}", is_warmup=True) for rid in warmup],
    )
    results: list[RawResult] = []
    t0 = {}
    await run_load(transport, plan, results.append, start_callback=lambda t: t0.setdefault("t", t))
    return results, t0["t"]


def _ok_results(ids: list[str], warmup: tuple[str, ...] = ()) -> tuple[list[RawResult], int]:
    return asyncio.run(_results(stream(["a", "b"], usage=usage(1, 2)), ids, warmup=warmup))


def _recorder(run_dir: Path, t0_ns: int, count_tokens=None, *, is_chat=False) -> RunRecorder:
    context = RecordContext(t0_ns=t0_ns, is_chat=is_chat, count_tokens=count_tokens)
    manifest = RunManifest(run_id="test-run", t0_ns=t0_ns)
    return RunRecorder(run_dir, context, {}, manifest)


def _ids(table) -> list[str]:
    return sorted(table.column("request_id").to_pylist())


@pytest.mark.parametrize(
    "count_tokens", [None, _one_token_per_char], ids=["no-tokenizer", "tokenizer"]
)
def test_every_outcome_round_trips_to_the_run_directory(tmp_path, count_tokens):
    ids = list(CASES)
    results, t0 = asyncio.run(_results(lambda p: CASES[p.request_id].outcome, ids, timeout_s=0.2))
    recorder = _recorder(tmp_path, t0, count_tokens)
    recorder.input_tokens.update({rid: i for i, rid in enumerate(ids)})
    for raw in results:
        recorder.add(raw)
    recorder.close(complete=True)

    run = open_run(tmp_path)
    rows = {row["request_id"]: row for row in run.requests.to_pylist()}
    assert sorted(rows) == sorted(ids)
    for i, rid in enumerate(ids):
        case, row = CASES[rid], rows[rid]
        assert (row["status"], row["error_class"], row["http_status"]) == (
            case.status,
            case.error_class,
            case.http_status,
        ), rid
        source, tokens = case.plain if count_tokens is None else case.tokenized
        assert (row["output_tokens_source"], row["output_tokens"]) == (source, tokens), rid
        assert row["t_scheduled_ns"] == i * 1_000_000, rid
        assert row["input_tokens"] == i and row["is_warmup"] is False
        assert (row["error_message"] is None) == (case.status is S.OK), rid
    assert rows["500"]["error_message"] == "boom"
    assert rows["stream-error"]["error_message"] == "out of memory"
    assert rows["usage"]["client_output_tokens"] == 3
    assert rows["usage"]["usage_completion_tokens"] == 5
    assert rows["usage"]["finish_reason"] == "length"
    chunks = run.chunks.column("request_id").to_pylist()
    assert {rid: chunks.count(rid) for rid in ids} == {
        rid: c.chunk_rows for rid, c in CASES.items()
    }


def test_cancelled_requests_round_trip_as_cancelled(tmp_path):
    ids = ["r0", "r1", "r2"]

    async def go():
        transport = FakeTransport(lambda p: stream(["a"]) if p.request_id == "r0" else HANG)
        plan = LoadPlan([RequestPayload(rid, b"{}") for rid in ids], [0.0] * 3)
        results, t0 = [], {}
        task = asyncio.create_task(
            run_load(
                transport, plan, results.append, start_callback=lambda t: t0.setdefault("t", t)
            )
        )
        async with asyncio.timeout(10):
            await transport.wait_for_in_flight(2)
            while not results:
                await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return results, t0["t"]

    results, t0 = asyncio.run(go())
    recorder = _recorder(tmp_path, t0)
    for raw in results:
        recorder.add(raw)
    recorder.close(complete=False, reason="cancelled by the test")
    rows = {r["request_id"]: r for r in open_run(tmp_path).requests.to_pylist()}
    statuses = {rid: (r["status"], r["error_class"]) for rid, r in rows.items()}
    assert statuses == {"r0": (S.OK, None), "r1": (S.CANCELLED, None), "r2": (S.CANCELLED, None)}
    assert all(r["t_done_ns"] >= r["t_sent_ns"] for r in rows.values())


def test_chat_stream_round_trips(tmp_path):
    results, t0 = asyncio.run(_results(stream(["Hel", "lo"], chat=True, usage=usage(3, 2)), ["c0"]))
    recorder = _recorder(tmp_path, t0, is_chat=True)
    recorder.add(results[0])
    recorder.close(complete=True)
    run = open_run(tmp_path)
    [row] = run.requests.to_pylist()
    assert (row["status"], row["output_tokens"], row["output_chars"]) == (S.OK, 2, 5)
    assert run.chunks.column("n_tokens").to_pylist() == [0, 1, 1, 0]  # role, 2 texts, usage


def test_manifest_says_incomplete_from_the_start(tmp_path):
    recorder = _recorder(tmp_path, 123)
    try:
        manifest = read_manifest(tmp_path)
        assert (manifest.complete, manifest.run_id, manifest.t0_ns) == (False, "test-run", 123)
        assert manifest.num_requests_recorded is None
    finally:
        recorder.close(complete=True)


def test_each_flush_is_readable_while_the_recorder_is_open(tmp_path):
    results, t0 = _ok_results([f"r{i}" for i in range(5)])
    recorder = _recorder(tmp_path, t0)
    try:
        for raw in results[:2]:
            recorder.add(raw)
        recorder.flush()
        assert _ids(open_run(tmp_path).requests) == ["r0", "r1"]
        for raw in results[2:]:
            recorder.add(raw)
        recorder.flush()
        assert _ids(open_run(tmp_path).requests) == [f"r{i}" for i in range(5)]
    finally:
        recorder.close(complete=True)


def _ids_of(results: list[RawResult]) -> list[str]:
    return sorted(r.request_id for r in results)


def _part_rows(run_dir) -> list[int]:
    """Rows of each requests part the writer holds until it closes, in order."""
    parts = sorted((run_dir / ".parts").glob("requests-*.parquet"))
    return [pq.ParquetFile(p).metadata.num_rows for p in parts]


def test_each_flush_appends_one_part(tmp_path):
    results, t0 = _ok_results([f"r{i}" for i in range(5)])
    recorder = _recorder(tmp_path, t0)
    for batch in (results[:2], results[2:4], [], results[4:]):
        for raw in batch:
            recorder.add(raw)
        recorder.flush()  # the empty batch writes nothing
    assert _part_rows(tmp_path) == [2, 2, 1]
    recorder.close(complete=True)  # small parts joined into one row group (the writer's)
    assert pq.ParquetFile(tmp_path / "requests.parquet").num_row_groups == 1
    assert _ids(open_run(tmp_path).requests) == _ids_of(results)


@pytest.mark.parametrize(
    ("complete", "reason"), [(True, None), (False, "SIGINT: the run was interrupted")]
)
def test_close_rewrites_the_manifest_with_the_end_state(tmp_path, complete, reason):
    results, t0 = _ok_results(["r0", "r1", "r2"], warmup=("w0",))
    recorder = _recorder(tmp_path, t0)
    for raw in results[:2]:
        recorder.add(raw)
    recorder.flush()
    for raw in results[2:]:
        recorder.add(raw)  # still pending: close flushes it
    recorder.close(complete=complete, reason=reason, server_metrics_samples=7)
    manifest = read_manifest(tmp_path)
    assert (manifest.complete, manifest.interrupted_reason) == (complete, reason)
    assert (manifest.num_requests_recorded, manifest.num_warmup_recorded) == (3, 1)
    assert manifest.server_metrics_samples == 7 and manifest.ended_at
    assert (manifest.run_id, manifest.t0_ns) == ("test-run", t0)
    assert open_run(tmp_path).manifest == manifest

    recorder.close(complete=not complete, reason="again")  # idempotent
    assert read_manifest(tmp_path) == manifest


def test_warmup_rows_go_to_warmup_parquet(tmp_path):
    results, t0 = _ok_results(["r0", "r1"], warmup=("w0", "w1", "w2"))
    recorder = _recorder(tmp_path, t0)
    for raw in results:
        recorder.add(raw)
    recorder.close(complete=True)
    run = open_run(tmp_path)
    assert _ids(run.requests) == ["r0", "r1"]
    assert _ids(run.warmup) == ["w0", "w1", "w2"]
    assert run.warmup.column("is_warmup").to_pylist() == [True] * 3
    assert run.requests.column("is_warmup").to_pylist() == [False] * 2
    assert all(t < 0 for t in run.warmup.column("t_done_ns").to_pylist())  # before t0
    assert set(run.chunks.column("request_id").to_pylist()) == {"r0", "r1"}
    assert (run.manifest.num_requests_recorded, run.manifest.num_warmup_recorded) == (2, 3)


CRASH_SCRIPT = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from pathlib import Path

    sys.path[:0] = [sys.argv[2], sys.argv[3]]
    from fake_transport import FakeTransport, stream, usage
    from harness.http.client import RawResult, RequestPayload
    from harness.load.recorder import RunRecorder
    from harness.load.records import RecordContext
    from slo.runrecord import RunManifest

    async def result(rid):
        raw = RawResult(rid, False, 0)
        await FakeTransport(stream(["a"], usage=usage(1, 1))).handle_request(
            RequestPayload(rid, b"{}"), raw
        )
        return raw

    recorder = RunRecorder(
        Path(sys.argv[1]), RecordContext(t0_ns=0, is_chat=False), {}, RunManifest(run_id="crash")
    )
    for batch in (["r0", "r1"], ["r2"]):
        for rid in batch:
            recorder.add(asyncio.run(result(rid)))
        recorder.flush()
    recorder.add(asyncio.run(result("never-flushed")))
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory) -> Path:
    """A run directory whose recorder's process was killed with SIGKILL after two flushes."""
    run_dir = tmp_path_factory.mktemp("crashed")
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(run_dir), str(HERE), str(ROOT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return run_dir


def test_crash_leaves_an_incomplete_manifest(crashed_run):
    manifest = read_manifest(crashed_run)
    assert (manifest.complete, manifest.run_id, manifest.ended_at) == (False, "crash", None)


def test_crash_keeps_every_flushed_row(crashed_run):
    run = open_run(crashed_run)
    assert _ids(run.requests) == ["r0", "r1", "r2"]
    assert set(run.chunks.column("request_id").to_pylist()) == {"r0", "r1", "r2"}
    assert json.loads((crashed_run / "manifest.json").read_text())["complete"] is False


def test_results_holding_the_pending_byte_bound_are_flushed_when_added(tmp_path):
    """Memory is bounded by `max_pending_bytes`, not by the flush interval: the result that
    brings the raw bytes waiting to the bound (at it, not just below) flushes them all."""
    results, t0 = _ok_results([f"r{i}" for i in range(4)])
    sizes = [sum(len(data) for _, data in raw.reads) for raw in results]
    assert len(set(sizes)) == 1 and sizes[0] > 0
    size = sizes[0]
    (tmp_path / "run").mkdir()
    recorder = _recorder(tmp_path / "run", t0)
    recorder.max_pending_bytes = 3 * size  # the third result reaches the bound exactly
    recorder.add(results[0])
    recorder.add(results[1])  # 2 * size: just below, kept
    assert recorder.writer.num_requests == 0
    recorder.add(results[2])  # 3 * size: at the bound, flushed
    assert recorder.writer.num_requests == 3
    recorder.add(results[3])  # the count starts again from zero
    assert recorder.writer.num_requests == 3
    recorder.close(complete=True)  # flushes the fourth as a part of its own
    run = open_run(tmp_path / "run")
    assert _ids(run.requests) == ["r0", "r1", "r2", "r3"]
