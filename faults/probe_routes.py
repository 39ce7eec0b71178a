"""Which optional routes a probed server serves: a route a server does not serve is no failure
of its input handling, so its cases are reported as not served (`probe.py`).

A route is optional when `route_checks` of `probe_cases.events` (the Responses and Messages
APIs) or `probe_cases.dense` (embeddings and rerank) holds a well-formed request for it. That request is sent once, before the cases; an answer of
404 or 405 says the route is not there. Any other answer, or none, leaves the route served:
its cases then run and are judged as any other.
"""

from __future__ import annotations

from faults.probe_cases import dense, events
from faults.raw_http import Outcome, RawServer

NOT_THERE = (404, 405)


async def unserved_routes(
    server: RawServer, model: str, paths: set[str], *, timeout_s: float
) -> dict[str, str]:
    """Route -> why it counts as not served, for the optional routes among `paths` that
    answer their well-formed request 404 or 405."""
    unserved = {}
    checks = {**events.route_checks(model), **dense.route_checks(model)}
    for path, (body, headers) in checks.items():
        if path not in paths:
            continue
        answer = await server.send("POST", path, timeout_s=timeout_s, body=body, headers=headers)
        if answer.outcome is Outcome.ANSWERED and answer.status in NOT_THERE:
            unserved[path] = (
                f"not served: a well-formed POST {path} answered {answer.status}, so the "
                "server does not serve this route."
            )
    return unserved
