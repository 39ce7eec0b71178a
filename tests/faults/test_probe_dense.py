"""The bad-input probe's embeddings and rerank cases against a server that serves neither
route: every case is reported as not served (a well-formed request there answers 404), not
failed, and the probe passes. (The reference server, which serves both, passes every case:
tests/engine_ref/test_embeddings.py.)"""

from __future__ import annotations

import asyncio

from broken_servers import create_app, serving

from faults.probe import ProbeConfig, run_probe
from faults.probe_cases import build_cases
from faults.probe_cases.case import Category
from faults.probe_report import Verdict


def test_routes_a_server_does_not_serve_are_not_served_not_failed():
    dense = [c for c in build_cases("m") if c.category is Category.DENSE_APIS]
    assert {c.path for c in dense} == {"/v1/embeddings", "/v1/rerank"} and len(dense) == 19
    with serving(create_app()) as url:
        config = ProbeConfig(url=url, only=frozenset({Category.DENSE_APIS}), timeout_s=5)
        report = asyncio.run(run_probe(config))
    assert len(report.results) == 19 and report.failed == ()
    assert all(r.verdict is Verdict.NOT_SERVED for r in report.results)
    reason = report.results[0].reason
    assert reason == (
        "not served: a well-formed POST /v1/embeddings answered 404, so the server does not "
        "serve this route."
    )
    assert report.passed
