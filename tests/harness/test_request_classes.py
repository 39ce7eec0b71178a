"""Request classes on the wire and in the run records: a workload's priority goes in the body
(vLLM's field), its tenant as OpenAI's `user`, its deadline as `x-request-deadline-ms`; the
run's requests.parquet and summary keep them. Through `bench run` against the mock server,
which tallies what each request carried."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import orjson
import pyarrow.parquet as pq
from click.testing import CliRunner
from fake_transport import FakeTransport
from test_sessions import _answer, _rows, _run

from harness.cli import bench
from harness.http.client import ClientOptions, RequestPayload, body_fields, request_headers
from harness.load.loadgen import LoadPlan
from harness.load.sessions import SessionPlan, sessions_from_rows
from slo.runrecord import Endpoint

WORKLOAD = """
name: two-tenants
num_requests: 22
seed: 1
source: {kind: synthetic, input: {dist: fixed, value: 8}, output: {dist: fixed, value: 3}}
arrivals: {process: poisson, rate: 200}
priority: 2
tenants:
  assign: weighted_round_robin
  mix:
    - {name: heavy, weight: 10}
    - {name: light, weight: 1, priority: 0, deadline_ms: 1500}
"""


def test_body_and_headers_of_a_row():
    options = ClientOptions(base_url="http://x/v1", model="m")
    row = {"prompt": "hi", "max_output_tokens": 3, "priority": -5, "tenant": "t1",
           "deadline_ms": 2_147_483_647}  # fmt: skip
    body = body_fields(options, row)
    assert (body["priority"], body["user"]) == (-5, "t1")
    assert request_headers(row) == {"x-request-deadline-ms": "2147483647"}
    bare = {"prompt": "hi", "max_output_tokens": 3, "priority": None, "tenant": None,
            "deadline_ms": None}  # fmt: skip
    assert "priority" not in body_fields(options, bare) and "user" not in body_fields(options, bare)
    assert request_headers(bare) is None
    assert body_fields(options, {**bare, "priority": 0})["priority"] == 0  # 0 is a priority


def test_every_turn_of_a_session_carries_its_deadline_and_the_session_header():
    rows = _rows(2, 2)
    for r in rows:
        r.update(deadline_ms=900 if r["session_id"] == "sess-0" else None, tenant="t", priority=1)
    seen = []

    def script(payload):
        seen.append((payload.request_id, payload.headers, orjson.loads(payload.body)))
        return _answer(payload, chat=True)

    options = ClientOptions(base_url="http://x/v1", model="m", endpoint=Endpoint.CHAT)
    sessions = SessionPlan(sessions_from_rows(rows, options), True, "x-session-id", None)
    payloads = [RequestPayload(r["request_id"], b"") for r in rows]
    plan = LoadPlan(payloads, [r["arrival_s"] for r in rows], sessions=sessions)
    asyncio.run(_run(FakeTransport(script), plan))
    headers = {rid: h for rid, h, _ in seen}
    assert (
        headers["s0t0"]
        == headers["s0t1"]
        == {
            "x-request-deadline-ms": "900",
            "x-session-id": "sess-0",
        }
    )
    assert headers["s1t1"] == {"x-session-id": "sess-1"}
    assert all((b["user"], b["priority"]) == ("t", 1) for _, _, b in seen)


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/stats", timeout=10) as resp:
        return json.load(resp)


def test_bench_run_sends_and_records_each_requests_class(mock_server, tmp_path):
    spec = tmp_path / "two-tenants.yaml"
    spec.write_text(WORKLOAD)
    with mock_server("--ttft-ms", "2", "--itl-ms", "1") as url:
        result = CliRunner().invoke(bench, ["run", "--url", url, "--tokenizer", "tiny-random",
                                            "--workload", str(spec), "--warmup", "0",
                                            "--out", str(tmp_path / "run")])  # fmt: skip
        seen = _stats(url)["classes_seen"]
    assert result.exit_code == 0, result.output
    # 22 requests dealt 10:1: 20 heavy (priority 2, no deadline), 2 light (priority 0, 1.5 s)
    assert seen == {'["heavy", 2, null]': 20, '["light", 0, "1500"]': 2}
    req = pq.read_table(tmp_path / "run" / "requests.parquet").to_pylist()
    by_tenant = {(r["tenant"], r["priority"], r["deadline_ms"]) for r in req}
    assert by_tenant == {("heavy", 2, None), ("light", 0, 1500)}
    assert sum(r["tenant"] == "light" for r in req) == 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [t["tenant"] for t in summary["fairness"]["tenants"]] == ["heavy", "light"]
    assert summary["deadlines"]["with_deadline"] == 2
    assert {s["label"]: s["n"] for s in summary["slices"]["priority"]} == {"0": 2, "2": 20}
    assert "Jain's fairness index" in result.output and "deadlines: " in result.output
