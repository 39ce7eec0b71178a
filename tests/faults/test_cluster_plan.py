"""Cluster fault kinds in fault plans: parsing (the issue's dashed spellings too), the managed
engine's fault-injection flag, the session's table, and the refusal of a target that is not a
P/D cluster (one sentence, from its /info)."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import pytest

from faults.cluster import check_cluster_target
from faults.plan import FaultPlan, FaultPlanError
from faults.session import ENGINE_FAULTS, FaultSession
from faults.window import CLUSTER_KINDS, FaultKind, Layer
from harness.errors import HarnessError
from harness.http.client import ClientOptions


def _plan(*windows: dict) -> FaultPlan:
    return FaultPlan.from_dict({"name": "c", "windows": list(windows)}, "plan.yaml")


@pytest.mark.parametrize(
    ("written", "kind"),
    [
        ("kill-decode-worker", FaultKind.KILL_DECODE_WORKER),
        ("kill_prefill_worker", FaultKind.KILL_PREFILL_WORKER),
        ("corrupt-kv", FaultKind.CORRUPT_KV),
        ("cut-kv-link", FaultKind.CUT_KV_LINK),
        ("cut_kv_link", FaultKind.CUT_KV_LINK),
    ],
)
def test_cluster_kinds_parse_as_engine_kinds_in_either_spelling(written, kind):
    (window,) = _plan({"kind": written, "at": "1s", "for": "2s"}).windows
    assert window.kind is kind and window.layer is Layer.ENGINE
    assert (window.at_s, window.for_s) == (1.0, 2.0)


def test_kv_link_toxics_take_the_proxys_parameters_and_a_worker():
    latency, bandwidth = _plan(
        {"kind": "kv-link-latency", "params": {"latency_ms": 300, "worker": 2}},
        {"kind": "kv_link_bandwidth", "params": {"rate_kbps": 8}},
    ).windows
    assert (latency.kind, dict(latency.params)) == (
        FaultKind.KV_LINK_LATENCY, {"latency_ms": 300.0, "jitter_ms": 0.0, "worker": 2}
    )  # fmt: skip
    assert (bandwidth.kind, dict(bandwidth.params)) == (
        FaultKind.KV_LINK_BANDWIDTH, {"rate_kbps": 8.0}
    )  # fmt: skip
    with pytest.raises(FaultPlanError, match="rate_kbps"):
        _plan({"kind": "kv_link_bandwidth", "params": {"rate_kbps": 0}})  # must be > 0
    with pytest.raises(FaultPlanError, match="direction"):
        _plan({"kind": "kv_link_latency", "direction": "both", "params": {"latency_ms": 1}})


def test_a_kill_names_its_worker_by_index_from_zero():
    (window,) = _plan({"kind": "kill_decode_worker", "params": {"worker": 0}}).windows
    assert window.param("worker") == 0
    (window,) = _plan({"kind": "kill_decode_worker"}).windows
    assert window.param("worker") is None  # the first live one of the role


@pytest.mark.parametrize(
    ("window", "words"),
    [
        ({"kind": "kill_decode_worker", "params": {"worker": -1}}, ["worker", "-1"]),
        ({"kind": "kill_decode_worker", "params": {"worker": 1.5}}, ["worker", "1.5"]),
        ({"kind": "corrupt_kv", "fraction": 0.5}, ["fraction", "whole target"]),
        ({"kind": "cut_kv_link", "params": {"bytes": 3}}, ["bytes"]),
        ({"kind": "cut_kv_line"}, ["cut_kv_line"]),
    ],
)
def test_bad_cluster_windows_are_one_sentence(window, words):
    with pytest.raises(FaultPlanError) as info:
        _plan(window)
    message = str(info.value)
    assert message.startswith("plan.yaml") and "\n" not in message
    assert all(w in message for w in words), message


def test_cluster_kinds_start_the_managed_engine_with_fault_injection():
    assert "--enable-fault-injection" in _plan({"kind": "corrupt_kv"}).managed_engine_args
    assert "--enable-fault-injection" in _plan({"kind": "kill_prefill_worker"}).managed_engine_args
    assert "--enable-fault-injection" not in _plan({"kind": "kill_engine"}).managed_engine_args


def test_the_link_faults_are_undone_at_their_window_end_and_the_kills_are_not():
    for kind in CLUSTER_KINDS:
        fault = ENGINE_FAULTS[kind]
        undone = kind not in (FaultKind.KILL_DECODE_WORKER, FaultKind.KILL_PREFILL_WORKER)
        assert (fault.end is not None, fault.undo_at_exit) == (undone, undone), kind
        assert not fault.outage


class _Info(http.server.BaseHTTPRequestHandler):
    info: dict = {}

    def do_GET(self):  # noqa: N802
        body = json.dumps(self.info).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def info_server():
    """A server answering /info with `handler.info`; yields (root URL, handler class)."""
    handler = type("Info", (_Info,), {"info": {}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_a_target_without_a_pd_cluster_is_refused_in_one_sentence(info_server):
    url, handler = info_server
    for info in ({}, {"cluster": {"replicas": 2, "workers": []}}):
        handler.info = info
        with pytest.raises(HarnessError) as raised:
            check_cluster_target(url, {FaultKind.CORRUPT_KV, FaultKind.SLOW_STEPS})
        message = str(raised.value)
        assert "corrupt_kv" in message and "not one" in message and "\n" not in message
    handler.info = {"cluster": {"pd": {"prefill_workers": ["u"], "decode_workers": []}}}
    check_cluster_target(url, {FaultKind.CORRUPT_KV})  # a P/D cluster: accepted
    check_cluster_target("http://127.0.0.1:9", {FaultKind.SLOW_STEPS})  # no cluster kind: no call


class _Server:
    """The face of a managed server that the session's cluster check and exit path use."""

    def __init__(self, port: int) -> None:
        self.port, self.restarts = port, 0

    def resume(self) -> None:
        pass


def test_the_session_refuses_a_cluster_plan_against_a_single_engine(info_server):
    url, handler = info_server
    handler.info = {"model": "m"}  # a single engine's /info: no cluster block
    port = int(url.rsplit(":", 1)[1])
    options = ClientOptions(base_url=f"{url}/v1", model="m")
    session = FaultSession(
        _plan({"kind": "cut-kv-link"}), options, server=_Server(port), max_connections=1
    )

    async def enter() -> None:
        async with session:
            pass

    with pytest.raises(HarnessError, match="cut_kv_link acts on a P/D cluster"):
        asyncio.run(enter())
