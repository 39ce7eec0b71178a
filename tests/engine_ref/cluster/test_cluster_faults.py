"""The router's `POST /admin/cluster_fault` (`engine_ref.cluster.cluster_faults`) over a stand-in
cluster (no worker processes): what each kind does to the next handoff's `kv_transfer_params`,
which worker a kill picks, the cutter's cut at exactly `CUT_AFTER_BYTES`, and bad bodies
answered in one sentence."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from engine_ref.cluster.cluster_faults import CUT_AFTER_BYTES, add_cluster_fault_route

KV = {"do_remote_decode": True, "transfer_id": "t", "decode_kv": "127.0.0.1:7000"}


class _Process:
    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True

    def join(self, timeout: float | None = None) -> None:
        pass


class _Worker:
    def __init__(self, index: int, role: str, kv_port: int | None = None) -> None:
        self.index, self.role, self.kv_port, self.process = index, role, kv_port, _Process()
        self.kv_host = "127.0.0.1"

    def kill(self) -> None:
        self.process.kill()

    @property
    def alive(self) -> bool:
        return not self.process.killed


class _Routing:
    def __init__(self, decode_kv_port: int = 7000) -> None:
        self.prefill = [_Worker(0, "prefill")]
        self.decode = [_Worker(1, "decode", decode_kv_port), _Worker(2, "decode", 7001)]


class _Cluster:
    def __init__(self, pd) -> None:
        self.pd, self.down = pd, []

    def mark_down(self, worker) -> None:
        self.down.append(worker.index)


async def _with_router(cluster, body):
    app = web.Application()
    add_cluster_fault_route(app, cluster)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        return await body(client)


async def _post(client, body: dict) -> tuple[int, dict]:
    answer = await client.post("/admin/cluster_fault", json=body)
    return answer.status, await answer.json()


def test_corrupt_kv_flips_a_bit_of_each_next_handoff_while_on():
    cluster = _Cluster(_Routing())

    async def body(client):
        faults = cluster.pd.link_faults
        decode = cluster.pd.decode[0]
        assert faults.kv_params(decode, KV) == KV  # off: untouched
        assert await _post(client, {"kind": "corrupt_kv", "on": True}) == (
            200, {"kind": "corrupt_kv", "on": True}
        )  # fmt: skip
        assert faults.kv_params(decode, KV) == {**KV, "fault": "flip_bit"}
        assert (await _post(client, {"kind": "corrupt_kv", "on": False}))[0] == 200
        assert faults.kv_params(decode, KV) == KV

    asyncio.run(_with_router(cluster, body))


def test_a_kill_takes_the_named_or_first_live_worker_of_its_role():
    cluster = _Cluster(_Routing())

    async def body(client):
        decode = cluster.pd.decode
        assert await _post(client, {"kind": "kill_decode_worker", "worker": 2}) == (
            200, {"kind": "kill_decode_worker", "killed": 2}
        )  # fmt: skip
        assert (decode[0].process.killed, decode[1].process.killed) == (False, True)
        assert (await _post(client, {"kind": "kill_decode_worker"}))[1]["killed"] == 1
        status, answer = await _post(client, {"kind": "kill_decode_worker"})
        assert status == 409 and answer["error"]["message"] == "No live decode worker to kill."
        assert (await _post(client, {"kind": "kill_prefill_worker"}))[1]["killed"] == 0
        assert cluster.down == [2, 1, 0]

    asyncio.run(_with_router(cluster, body))


@pytest.mark.parametrize(
    ("cluster_pd", "body", "status", "message"),
    [
        (None, {"kind": "corrupt_kv"}, 409,
         "corrupt_kv needs a P/D cluster; this router serves replicas."),
        ("pd", {"kind": "flip"}, 400, "kind must be one of kill_decode_worker, "
         "kill_prefill_worker, corrupt_kv, cut_kv_link, kv_link_via; got 'flip'."),
        ("pd", {"kind": "cut_kv_link", "on": "yes"}, 400, "on must be true or false."),
        ("pd", {"kind": "kill_decode_worker", "worker": "1"}, 400,
         "worker must be a worker index (an integer)."),
        ("pd", {"kind": "kill_decode_worker", "worker": 7}, 409,
         "No live decode worker 7 to kill."),
        ("pd", {"kind": "kv_link_via", "worker": 0}, 400,
         "kv_link_via needs worker: a decode worker's index."),
    ],
)  # fmt: skip
def test_bad_bodies_get_one_sentence(cluster_pd, body, status, message):
    cluster = _Cluster(None if cluster_pd is None else _Routing())

    async def run(client):
        return await _post(client, body)

    got_status, answer = asyncio.run(_with_router(cluster, run))
    assert (got_status, answer["error"]["message"]) == (status, message)


def test_kv_link_via_sends_one_decode_workers_kv_elsewhere():
    cluster = _Cluster(_Routing())

    async def body(client):
        faults, (d1, d2) = cluster.pd.link_faults, cluster.pd.decode
        on = {"kind": "kv_link_via", "worker": 2, "host": "127.0.0.1", "port": 9999}
        assert (await _post(client, on))[0] == 200
        assert faults.kv_params(d2, KV)["decode_kv"] == "127.0.0.1:9999"
        assert faults.kv_params(d1, KV) == KV  # the other worker's link is untouched
        assert (await _post(client, {**on, "on": False}))[0] == 200
        assert faults.kv_params(d2, KV) == KV

    asyncio.run(_with_router(cluster, body))


@pytest.mark.parametrize(
    ("sent", "passed"),
    [(CUT_AFTER_BYTES - 1, CUT_AFTER_BYTES - 1), (CUT_AFTER_BYTES, CUT_AFTER_BYTES),
     (CUT_AFTER_BYTES + 1, CUT_AFTER_BYTES), (100_000, CUT_AFTER_BYTES)],
)  # fmt: skip
def test_the_cutter_passes_at_most_its_bytes_then_closes_both_ends(sent, passed):
    """A KV receiver behind the cutter gets the first CUT_AFTER_BYTES bytes (all of a shorter
    transfer) and then an end without the rest; the sender never gets a reply."""

    async def scenario():
        received = bytearray()
        done = asyncio.Event()

        async def receiver(reader, writer):
            while chunk := await reader.read(65536):
                received.extend(chunk)
            done.set()
            writer.close()

        kv_server = await asyncio.start_server(receiver, "127.0.0.1", 0)
        kv_port = kv_server.sockets[0].getsockname()[1]
        cluster = _Cluster(_Routing(decode_kv_port=kv_port))

        async def body(client):
            assert (await _post(client, {"kind": "cut_kv_link", "on": True}))[0] == 200
            kv = cluster.pd.link_faults.kv_params(cluster.pd.decode[0], KV)
            host, port = kv["decode_kv"].split(":")
            assert int(port) != kv_port
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"x" * sent)
            if sent < CUT_AFTER_BYTES:
                writer.write_eof()  # a short transfer ends: the cutter closes on its end
            reply = b""
            try:
                reply = await asyncio.wait_for(reader.read(), 5)
                await writer.drain()
            except ConnectionError:
                pass
            writer.close()
            await asyncio.wait_for(done.wait(), 5)
            assert reply == b""
            assert cluster.pd.link_faults.cut_connections == 1
            assert (await _post(client, {"kind": "cut_kv_link", "on": False}))[0] == 200
            assert cluster.pd.link_faults.kv_params(cluster.pd.decode[0], KV) == KV

        try:
            await _with_router(cluster, body)
        finally:
            kv_server.close()
        return bytes(received)

    assert asyncio.run(scenario()) == b"x" * passed


def test_a_kv_link_window_puts_a_fault_proxy_in_front_of_each_decode_workers_kv_port():
    """`faults.cluster`'s kv_link windows against this route: while on, the next handoff to a
    decode worker goes to a proxy that forwards to its KV port; off: straight again."""
    from faults.cluster import kv_link_toxic_off, kv_link_toxic_on
    from faults.window import Window
    from harness.errors import HarnessError

    async def scenario():
        received = bytearray()

        async def receiver(reader, writer):
            received.extend(await reader.read())
            writer.close()

        kv_server = await asyncio.start_server(receiver, "127.0.0.1", 0)
        kv_port = kv_server.sockets[0].getsockname()[1]
        routing = _Routing(decode_kv_port=kv_port)
        routing.decode = routing.decode[:1]  # one decode worker, cluster index 1
        cluster = _Cluster(routing)
        app = web.Application()
        add_cluster_fault_route(app, cluster)
        info = {"cluster": {"pd": {"prefill_workers": ["p"],
                                   "decode_workers": [{"url": "d", "kv_port": kv_port}]}}}  # fmt: skip

        async def answer_info(_request):
            return web.json_response(info)

        app.router.add_get("/info", answer_info)
        async with TestServer(app, host="127.0.0.1") as server:
            target = type("Managed", (), {"port": server.port})()
            window = Window(kind="kv_link_latency", params=(("latency_ms", 0),))
            await kv_link_toxic_on(target, window)
            kv = cluster.pd.link_faults.kv_params(routing.decode[0], KV)
            host, port = kv["decode_kv"].split(":")
            assert int(port) != kv_port
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"handoff")
            writer.write_eof()
            await writer.drain()
            for _ in range(100):
                if received:
                    break
                await asyncio.sleep(0.02)
            writer.close()
            await kv_link_toxic_off(target, window)
            assert cluster.pd.link_faults.kv_params(routing.decode[0], KV) == KV
            wrong = Window(kind="kv_link_bandwidth", params=(("rate_kbps", 8), ("worker", 0)))
            try:
                await kv_link_toxic_on(target, wrong)  # worker 0 is the prefill worker
            except HarnessError as exc:
                message = str(exc)
        kv_server.close()
        await kv_server.wait_closed()
        return bytes(received), message

    received, message = asyncio.run(scenario())
    assert received == b"handoff"
    assert message == (
        "the kv_link_bandwidth window names worker 0, which is not a decode worker of the "
        "cluster (decode workers: 1)."
    )
