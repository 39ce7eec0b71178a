"""The router over stand-in workers in this process (no engine, no worker processes): a worker
that refuses connections gets nothing delivered, so the request goes to another, once."""

from __future__ import annotations

import asyncio
import json
import socket

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from engine_ref.cluster.replicas import LocalWorker
from engine_ref.cluster.router import Cluster, create_router_app
from engine_ref.cluster.routing import RoundRobin
from engine_ref.serving.interface import EngineConfig
from engine_ref.serving.server import ServerConfig


class StandInWorker(LocalWorker):
    """A worker whose process is this one: always alive, never watched."""

    def __init__(self, index: int, url: str) -> None:
        super().__init__(index, url, process=None)  # type: ignore[arg-type]

    @property
    def alive(self) -> bool:
        return True

    def watch(self, on_exit) -> None:
        pass

    def unwatch(self) -> None:
        pass


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _answering_worker() -> TestServer:
    async def info(request: web.Request) -> web.Response:
        return web.json_response({"engine": "stand-in", "served_model_name": "m"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})

    async def complete(request: web.Request) -> web.Response:
        return web.json_response({"echo": json.loads(await request.read())})

    app = web.Application()
    app.router.add_get("/info", info)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


def test_a_refused_connection_is_routed_again_to_another_worker():
    async def scenario() -> tuple[list, list[int], int]:
        answering = await _answering_worker()
        url = f"http://127.0.0.1:{answering.port}"
        refused = f"http://127.0.0.1:{_closed_port()}"
        workers = [StandInWorker(0, url), StandInWorker(1, refused)]
        config = ServerConfig(engine=EngineConfig(model="tiny-random"), port=0)
        cluster = Cluster(workers, RoundRobin(), config, tokenizer=None)
        client = TestClient(TestServer(create_router_app(cluster)))
        await client.start_server()
        try:
            answers = []
            for i in range(3):  # round robin: 0, then 1 (refused: 0 again), then 1 (again)
                response = await client.post("/v1/completions", json={"n": i})
                answers.append((response.status, await response.json()))
            health = await client.get("/health")
            return answers, cluster.routed, health.status
        finally:
            await client.close()
            await answering.close()

    answers, routed, health = asyncio.run(scenario())
    assert answers == [(200, {"echo": {"n": i}}) for i in range(3)]
    assert routed == [3, 2]  # worker 1 was chosen twice and reached never
    assert health == 200  # its process runs: not marked down for a refused connection
