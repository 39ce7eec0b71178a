"""The router: one OpenAI-compatible server in front of N reference-engine workers.

Every route the single server serves is served here. The generation and dense routes
(/v1/completions, /v1/chat/completions, /v1/responses, /v1/messages, /v1/embeddings,
/v1/rerank) go to the worker the routing policy chooses (`routing`); /v1/models and /info to
the first live worker (/info adds `cluster`: replicas, router policy, worker URLs); /metrics
merges every live worker's exposition (`exposition`); /health answers "ok" while every worker
runs, 200 with `{"status": "degraded", ...}` while some do, 503 when none does.

A body is read once: the same bytes are tokenized for the policy (only prefix-affinity needs
it; in a worker thread, as the server parses) and sent on. Answers pass through as the worker
gave them, status and body included, so a bad request gets the worker's own 4xx, plus an
`x-bench-worker: worker-<i>` header naming the worker that served it; a stream is relayed
chunk by chunk as the worker writes it, never buffered. A client that goes away closes
the connection to the worker, which aborts the request there.

Failures are explicit. A request whose worker could not be reached (the connection was
refused: nothing was delivered) is routed again among the other workers, once. A request in
flight on a worker that dies gets a 502 whose body says which worker died and how; a stream
already under way ends with an error event in its API's shape instead. A dead worker is taken
out of routing the moment its process exits (`replicas.LocalWorker.watch`).

With --enable-fault-injection, `POST /admin/step_delay` goes to every live worker and
`POST /admin/cluster_fault` kills a worker or breaks the P/D KV link (`cluster_faults`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from engine_ref.cluster.cluster_faults import add_cluster_fault_route
from engine_ref.cluster.exposition import RouterCounts, merge_expositions, router_families
from engine_ref.cluster.replicas import LocalWorker, start_workers, stop_workers
from engine_ref.cluster.routing import Policy, make_policy, prompt_block_keys
from engine_ref.serving.embeddings import DENSE_PATHS
from engine_ref.serving.endpoints import ENDPOINTS, Endpoint
from engine_ref.serving.errors import ApiError, error_body
from engine_ref.serving.events_api import EVENT_ENDPOINTS
from engine_ref.serving.interface import ServedTokenizer
from engine_ref.serving.metrics import CONTENT_TYPE
from engine_ref.serving.middlewares import api_key_guard, json_errors, json_response
from engine_ref.serving.requests import decode_json_body
from engine_ref.serving.server import ServerConfig, ServerError, serve_app

__all__ = [
    "Cluster",
    "NotDelivered",
    "WORKER_HEADER",
    "create_router_app",
    "forwarded_headers",
    "relay",
    "routed_error",
    "serve_cluster",
    "worker_name",
]

LOG = logging.getLogger("engine_ref.cluster.router")
_CLUSTER = web.AppKey("engine_ref_cluster", object)
GENERATION_ENDPOINTS: dict[str, Endpoint] = {
    e.path: e for e in (*ENDPOINTS.values(), *EVENT_ENDPOINTS)
}
ROUTED_PATHS = (*GENERATION_ENDPOINTS, *DENSE_PATHS.values())
# Headers that describe one hop, not the message; aiohttp sets its own.
_HOP_HEADERS = frozenset(
    {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "upgrade",
     "te", "trailer", "proxy-authorization", "proxy-connection", "date", "server"}
)  # fmt: skip
_PARSE_WORKERS = 4
_SCRAPE_TIMEOUT_S = 10.0
_EXIT_WAIT_S, _EXIT_WAIT_STEPS = 1.0, 20
WORKER_HEADER = "x-bench-worker"  # which worker served a routed answer (docs/CONTRACTS.md)


@dataclass
class Cluster:
    """The router's state: its workers, policy and counters (index = worker index)."""

    workers: list[LocalWorker]
    policy: Policy
    config: ServerConfig
    tokenizer: ServedTokenizer | None
    session: aiohttp.ClientSession | None = None
    served_model: str = ""
    max_model_len: int = 0
    fallbacks: int = 0
    pd: Any = None  # `pd.PDRouting` in P/D mode: it routes the requests (`pd` imports this module)

    def __post_init__(self) -> None:
        self.routed = [0] * len(self.workers)
        self.inflight = [0] * len(self.workers)
        self.down: dict[int, str] = {}  # worker index -> how its process ended
        self.parser = concurrent.futures.ThreadPoolExecutor(_PARSE_WORKERS, "route-parse")

    def live(self) -> list[LocalWorker]:
        return [w for w in self.workers if w.index not in self.down and w.alive]

    def mark_down(self, worker: LocalWorker) -> None:
        if worker.index not in self.down:
            self.down[worker.index] = worker.exit_description()
            LOG.warning("worker %d (%s) %s", worker.index, worker.url, self.down[worker.index])

    def counts(self) -> RouterCounts:
        up = [w.index not in self.down and w.alive for w in self.workers]
        return RouterCounts(self.policy.name, self.routed, self.inflight, up, self.fallbacks)


class NotDelivered(Exception):
    """The worker could not be reached: the request never left the router."""


def create_router_app(cluster: Cluster) -> web.Application:
    """The router's aiohttp application over started workers (`start_workers`)."""
    config = cluster.config
    middlewares = [json_errors]
    if config.api_key is not None:
        middlewares.append(api_key_guard(config.api_key))
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[_CLUSTER] = cluster
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    for path in ROUTED_PATHS:
        app.router.add_post(path, functools.partial(_route, path=path))
    app.router.add_get("/v1/models", _first_live)
    app.router.add_get("/health", _health)
    app.router.add_get("/info", _info)
    app.router.add_get("/metrics", _metrics)
    if config.enable_fault_injection:
        app.router.add_post("/admin/step_delay", _broadcast)
        add_cluster_fault_route(app, cluster)  # /admin/cluster_fault
    return app


async def _on_startup(app: web.Application) -> None:
    cluster: Cluster = app[_CLUSTER]
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0)
    cluster.session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout, auto_decompress=False
    )
    for worker in cluster.workers:
        worker.watch(cluster.mark_down)
    auth = {} if cluster.config.api_key is None else _bearer(cluster.config.api_key)
    first = cluster.workers[0].url
    async with cluster.session.get(f"{first}/info") as answer:
        info = await answer.json()
    async with cluster.session.get(f"{first}/v1/models", headers=auth) as answer:
        (model,) = (await answer.json())["data"]
    cluster.served_model = info.get("served_model_name") or model["id"]
    cluster.max_model_len = int(model["max_model_len"])


async def _on_cleanup(app: web.Application) -> None:
    cluster: Cluster = app[_CLUSTER]
    for worker in cluster.workers:
        worker.unwatch()  # they are about to be stopped: not a failure
    cluster.parser.shutdown(wait=False, cancel_futures=True)
    if cluster.session is not None:
        await cluster.session.close()


def _bearer(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


def routed_error(status: int, message: str, path: str, *, code: str | None = None) -> web.Response:
    """An error answer in the shape of `path`'s API."""
    error = ApiError(status, message, type="server_error", code=code)
    endpoint = GENERATION_ENDPOINTS.get(path)
    body = error.body() if endpoint is None else endpoint.error_body(error)
    return json_response(body, status=status)


async def _route(request: web.Request, *, path: str) -> web.StreamResponse:
    cluster: Cluster = request.app[_CLUSTER]
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = cluster.config.max_body_bytes
        message = (
            f"The request body exceeds this server's limit of {limit} bytes (--max-body-bytes)."
        )
        error = ApiError(413, message, code="request_too_large")
        return json_response(error.body(), status=413)
    if cluster.pd is not None:
        return await cluster.pd.route(request, cluster, path, raw)
    keys: tuple[int, ...] = ()
    if cluster.policy.needs_block_keys and path in GENERATION_ENDPOINTS:
        loop = asyncio.get_running_loop()
        keys = await loop.run_in_executor(cluster.parser, _block_keys, cluster, path, raw)
    unreachable: set[int] = set()
    for _ in range(2):  # a second try, elsewhere, only when the first never reached its worker
        live = [w for w in cluster.live() if w.index not in unreachable]
        if not live and not unreachable:
            return routed_error(
                503, "No worker of this cluster is running.", path, code="no_worker"
            )
        if not live:
            break
        route = cluster.policy.choose(keys, {w.index: cluster.inflight[w.index] for w in live})
        cluster.routed[route.worker] += 1
        cluster.fallbacks += route.fallback
        worker = cluster.workers[route.worker]
        cluster.inflight[worker.index] += 1
        try:
            return await relay(request, cluster, worker, raw)
        except NotDelivered:
            unreachable.add(worker.index)
            if not worker.alive:
                cluster.mark_down(worker)
        finally:
            cluster.inflight[worker.index] -= 1
    return routed_error(502, "No worker of this cluster could be reached.", path, code="no_worker")


def _block_keys(cluster: Cluster, path: str, raw: bytes) -> tuple[int, ...]:
    """The prompt's block keys, tokenized as the worker will; none for a body the worker will
    refuse (it answers the 4xx) or without a tokenizer."""
    if cluster.tokenizer is None:
        return ()
    try:
        gen = GENERATION_ENDPOINTS[path].parse(
            decode_json_body(raw),
            tokenizer=cluster.tokenizer,
            served_model=cluster.served_model,
            max_model_len=cluster.max_model_len,
            max_prompt_chars=cluster.config.max_prompt_chars,
        )
    except (ApiError, ValueError):
        return ()
    if not gen.prompts:
        return ()
    return prompt_block_keys(gen.prompts[0], cluster.config.engine.block_size, gen.cache_salt)


def worker_name(worker: LocalWorker) -> str:
    """The name a routed answer's `x-bench-worker` header gives `worker`: a P/D worker's own
    (`decode-0`), else `worker-<index>`."""
    return getattr(worker, "name", None) or f"worker-{worker.index}"


def forwarded_headers(headers: object) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}  # type: ignore[attr-defined]


async def relay(
    request: web.Request, cluster: Cluster, worker: LocalWorker, raw: bytes
) -> web.StreamResponse:
    """Send `raw` to `worker` and pass its answer back; raises NotDelivered when the
    connection was refused."""
    assert cluster.session is not None
    url = f"{worker.url}{request.path_qs}"
    try:
        async with cluster.session.post(
            url, data=raw, headers=forwarded_headers(request.headers)
        ) as up:
            headers = {**forwarded_headers(up.headers), WORKER_HEADER: worker_name(worker)}
            if up.content_type != "text/event-stream":
                return web.Response(status=up.status, body=await up.read(), headers=headers)
            response = web.StreamResponse(status=up.status, headers=headers)
            await response.prepare(request)
            try:
                async for chunk in up.content.iter_any():
                    await response.write(chunk)
            except (TimeoutError, aiohttp.ClientError) as exc:
                frame = _error_frame(request.path, await _lost(cluster, worker, exc))
                with contextlib.suppress(ConnectionResetError):
                    await response.write(frame)
            except ConnectionResetError:  # our client went away; leaving closes the worker's
                LOG.debug("client of %s went away", request.path)
                return response
            with contextlib.suppress(ConnectionResetError):
                await response.write_eof()
            return response
    except aiohttp.ClientConnectorError as exc:
        raise NotDelivered from exc
    except (TimeoutError, aiohttp.ClientError) as exc:
        return routed_error(
            502, await _lost(cluster, worker, exc), request.path, code="worker_lost"
        )


async def _lost(cluster: Cluster, worker: LocalWorker, exc: BaseException) -> str:
    """One sentence on a request lost with its worker. A killed process closes its sockets
    just before it can be reaped, so a dropped connection waits a moment for the exit."""
    for _ in range(_EXIT_WAIT_STEPS):
        if not worker.alive:
            break
        await asyncio.sleep(_EXIT_WAIT_S / _EXIT_WAIT_STEPS)
    if not worker.alive:
        cluster.mark_down(worker)
        return (
            f"Worker {worker.index} ({worker.url}) {worker.exit_description()} while serving "
            "this request."
        )
    reason = str(exc) or type(exc).__name__
    return f"Worker {worker.index} ({worker.url}) dropped this request: {reason}."


def _error_frame(path: str, message: str) -> bytes:
    """A mid-stream failure event in the shape of `path`'s API."""
    if path == "/v1/messages":
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    error = error_body(message, type="server_error", code="worker_lost")
    if path == "/v1/responses":
        return f"event: error\ndata: {json.dumps({'type': 'error', **error})}\n\n".encode()
    return f"data: {json.dumps(error)}\n\n".encode()


async def _first_live(request: web.Request) -> web.StreamResponse:
    cluster: Cluster = request.app[_CLUSTER]
    assert cluster.session is not None
    for worker in cluster.live():
        try:
            url = f"{worker.url}{request.path_qs}"
            async with cluster.session.get(url, headers=forwarded_headers(request.headers)) as up:
                body = await up.read()
                return web.Response(
                    status=up.status, body=body, headers=forwarded_headers(up.headers)
                )
        except aiohttp.ClientError:
            continue
    return routed_error(
        503, "No worker of this cluster is running.", request.path, code="no_worker"
    )


async def _info(request: web.Request) -> web.Response:
    cluster: Cluster = request.app[_CLUSTER]
    answer = await _first_live(request)
    if answer.status != 200 or not isinstance(answer, web.Response) or answer.body is None:
        return answer
    info = json.loads(answer.body)  # type: ignore[arg-type]
    info["cluster"] = {
        "replicas": len(cluster.workers),
        "router": cluster.policy.name,
        "workers": [w.url for w in cluster.workers],
    }
    if cluster.pd is not None:
        info["cluster"]["pd"] = cluster.pd.describe()
    return json_response(info)


async def _health(request: web.Request) -> web.Response:
    cluster: Cluster = request.app[_CLUSTER]
    live = {w.index for w in cluster.live()}
    if len(live) == len(cluster.workers):
        return web.Response(text="ok")
    if not live:
        return routed_error(
            503, "No worker of this cluster is running.", "/health", code="no_worker"
        )
    workers = [
        {"index": w.index, "url": w.url, "up": w.index in live, "exit": cluster.down.get(w.index)}
        for w in cluster.workers
    ]
    return json_response({"status": "degraded", "workers": workers})


async def _metrics(request: web.Request) -> web.Response:
    cluster: Cluster = request.app[_CLUSTER]
    live = cluster.live()
    texts = await asyncio.gather(*(_scrape(cluster, w) for w in live))
    merged = merge_expositions([(str(w.index), t) for w, t in zip(live, texts, strict=True)])
    body = merged + router_families(cluster.counts())
    if cluster.pd is not None:
        body += cluster.pd.families()
    return web.Response(body=body.encode(), headers={"Content-Type": CONTENT_TYPE})


async def _scrape(cluster: Cluster, worker: LocalWorker) -> str:
    assert cluster.session is not None
    try:
        timeout = aiohttp.ClientTimeout(total=_SCRAPE_TIMEOUT_S)
        async with cluster.session.get(f"{worker.url}/metrics", timeout=timeout) as up:
            return await up.text() if up.status == 200 else ""
    except (TimeoutError, aiohttp.ClientError):
        return ""  # a worker that just died: its families drop out of this scrape


async def _broadcast(request: web.Request) -> web.StreamResponse:
    """Fault injection: the same /admin/step_delay body to every live worker."""
    cluster: Cluster = request.app[_CLUSTER]
    assert cluster.session is not None
    raw = await request.read()
    answer: web.StreamResponse = routed_error(503, "No worker is running.", request.path)
    for worker in cluster.live():
        url = f"{worker.url}{request.path_qs}"
        async with cluster.session.post(
            url, data=raw, headers=forwarded_headers(request.headers)
        ) as up:
            answer = web.Response(
                status=up.status, body=await up.read(), headers=forwarded_headers(up.headers)
            )
    return answer


async def serve_cluster(
    config: ServerConfig,
    *,
    replicas: int,
    policy: str,
    log_level: str = "warning",
    on_listening: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    tokenizer_loader: Callable[[str], ServedTokenizer] | None = None,
    ray_address: str | None = None,
) -> None:
    """Start `replicas` workers serving `config`, serve the router on `config`'s host and
    port until `stop` is set, then stop every worker (on every exit path).
    `tokenizer_loader(model)` loads the served tokenizer for prefix-affinity
    (default: `engine_ref.loading.tokenizer_files.load_tokenizer`). With `ray_address` the
    workers are Ray actors on that cluster (`ray_placement`); the router is the same."""
    try:
        chosen = make_policy(policy)
    except ValueError as exc:
        raise ServerError(str(exc)) from None
    loop = asyncio.get_running_loop()
    tokenizer = None
    if chosen.needs_block_keys:
        if tokenizer_loader is None:
            from engine_ref.loading.tokenizer_files import load_tokenizer as tokenizer_loader
        tokenizer = await loop.run_in_executor(None, tokenizer_loader, config.engine.model)
    start = functools.partial(start_workers, config, replicas, log_level=log_level)
    stop_all: Callable[[list], None] = stop_workers
    if ray_address is not None:  # Ray loads only when asked for
        from engine_ref.cluster.ray_placement import start_ray_workers, stop_ray_workers

        start = functools.partial(
            start_ray_workers, config, replicas, ray_address, log_level=log_level
        )
        stop_all = stop_ray_workers
    workers = await loop.run_in_executor(None, start)
    try:
        cluster = Cluster(workers, chosen, config, tokenizer)
        what = f"routing to {len(workers)} workers"
        await serve_app(create_router_app(cluster), config, on_listening, stop, what)
    finally:
        await loop.run_in_executor(None, stop_all, workers)
