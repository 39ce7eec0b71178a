"""The bad-input probe's Responses and Messages cases (`probe_cases/events.py`): a server that
does not serve a route has that route's cases reported as not served, not failed; a server that
serves one has its cases judged like any other. (The reference server, which serves both, must
pass them all: tests/engine_ref/test_server_events.py.)"""

from __future__ import annotations

import asyncio
import io
import json

from aiohttp import web
from broken_servers import create_app, serving
from rich.console import Console

from faults.probe import ProbeConfig, run_probe
from faults.probe_cases import build_cases
from faults.probe_cases.case import REJECT, Category
from faults.probe_cases.events import MESSAGES, RESPONSES
from faults.probe_cli import render_report
from faults.probe_report import HealthAfter, Verdict

ONLY = frozenset({Category.EVENT_APIS})


def _probe(app: web.Application):
    with serving(app) as url:
        return asyncio.run(run_probe(ProbeConfig(url=url, only=ONLY, timeout_s=5, num_streams=1)))


def test_the_cases_cover_both_routes_and_must_all_be_rejected():
    cases = [c for c in build_cases("m") if c.category is Category.EVENT_APIS]
    assert len([c for c in cases if c.path == RESPONSES]) == 9
    assert len([c for c in cases if c.path == MESSAGES]) == 10
    assert all(c.expect is REJECT for c in cases)
    names = {c.name for c in cases}
    assert {"responses-input-missing", "messages-api-max-tokens-missing",
            "responses-unknown-model", "messages-api-unknown-model"} <= names  # fmt: skip
    missing = next(c for c in cases if c.name == "messages-api-max-tokens-missing")
    assert "max_tokens" not in json.loads(missing.body)
    assert ("anthropic-version", "2023-06-01") in missing.headers


def test_routes_a_server_does_not_serve_are_reported_not_served():
    report = _probe(create_app())  # completions and chat only: 404 on both routes
    assert len(report.results) == 19
    assert {r.verdict for r in report.results} == {Verdict.NOT_SERVED}
    assert all(r.health_after is HealthAfter.OK for r in report.results)
    assert report.passed and report.failed == () and len(report.not_served) == 19
    first = report.results[0]
    assert first.reason == (
        "not served: a well-formed POST /v1/responses answered 404, so the server does not "
        "serve this route."
    )
    assert json.loads(report.to_json())["num_not_served"] == 19
    console = Console(width=100, record=True, color_system=None, file=io.StringIO())
    console.print(render_report(report))
    text = console.export_text()
    assert "event-apis (19 not served)" in text
    assert "all 0 cases served passed; 19 not served (their route is not there)." in text
    assert "failed cases" not in text


async def _messages_that_accept_anything(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"type": "message", "content": []})


def test_a_served_route_has_its_cases_judged():
    """A server answering 200 to every Messages request serves the route, so its bad requests
    fail (accepted where a 4xx is due); its Responses route is still not served."""
    app = create_app()
    app.router.add_post("/v1/messages", _messages_that_accept_anything)
    report = _probe(app)
    by_path = {}
    for case, result in zip(
        [c for c in build_cases("m") if c.category is Category.EVENT_APIS],
        report.results,
        strict=True,
    ):
        by_path.setdefault(case.path, set()).add(result.verdict)
    assert by_path == {RESPONSES: {Verdict.NOT_SERVED}, MESSAGES: {Verdict.FAIL}}
    failed = {r.name: r for r in report.failed}
    assert failed["messages-api-max-tokens-missing"].reason == (
        "accepted with 200 a request that must be rejected with a 4xx."
    )
    assert not report.passed
