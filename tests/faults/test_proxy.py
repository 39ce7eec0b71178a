"""The fault proxy between the harness's own client and the in-process mock server: what each
toxic does to requests, as `harness/http/client.py` and `harness/load/records.py` classify them."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time

import aiohttp
import pytest
import uvloop

from faults.proxy import TOXIC_KINDS, FaultProxy, Toxic
from harness.http.client import AiohttpTransport, ClientOptions, RequestPayload, build_body, send
from harness.load.loadgen import LoadPlan, run_load
from harness.load.records import RecordContext, to_rows
from harness.targets.mock_server import MockConfig, start_mock

FAST = MockConfig(ttft_ms=20, itl_ms=2)
RUNNERS = {"asyncio": asyncio.run, "uvloop": uvloop.run}


class FreshConnectionTransport:
    """The harness's client path on a session that opens a new connection per request, so the
    proxy's connection numbers follow the request order."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options

    async def __aenter__(self) -> FreshConnectionTransport:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.session.close()

    async def handle_request(self, payload, result) -> None:
        await send(self.session, self.options, payload, result)


@dataclasses.dataclass
class Outcome:
    rows: list[dict]  # request records, in request order
    raws: list  # the RawResults, in request order

    def classes(self) -> set[tuple[str, str | None]]:
        return {(r["status"], r["error_class"]) for r in self.rows}

    def ttft_ms(self) -> float:
        """Median TTFT (send to first token) of the requests that got a token."""
        values = [
            (r["t_first_token_ns"] - r["t_sent_ns"]) / 1e6
            for r in self.rows
            if r["t_first_token_ns"] is not None
        ]
        return statistics.median(values)


async def drive(
    port: int,
    n: int,
    *,
    timeout_s: float = 5.0,
    stream: bool = True,
    max_tokens: int = 8,
    concurrency: int | None = None,
    fresh: bool = False,
    transport=None,
) -> Outcome:
    """Send `n` completions to 127.0.0.1:`port` through the harness's client and load generator
    (all at once, or closed loop with `concurrency` users); return records in request order."""
    options = ClientOptions(
        base_url=f"http://127.0.0.1:{port}/v1", model="mock", timeout_s=timeout_s, stream=stream
    )
    spec = {"prompt": "a b c", "max_output_tokens": max_tokens, "ignore_eos": True}
    payloads = [RequestPayload(f"r{i:02d}", build_body(options, spec)) for i in range(n)]
    arrivals = None if concurrency else [0.0] * n
    plan = LoadPlan(payloads, arrivals, concurrency=concurrency)
    results, t0 = [], {}

    async def go(t) -> None:
        await run_load(t, plan, results.append, start_callback=lambda t: t0.setdefault("t", t))

    async with asyncio.timeout(timeout_s * n + 10):
        if transport is not None:
            t = transport
            t.options = options
            await go(t)
        elif fresh:
            async with FreshConnectionTransport(options) as t:
                await go(t)
        else:
            async with AiohttpTransport(options, max_connections=n) as t:
                await go(t)
    results.sort(key=lambda raw: raw.request_id)
    ctx = RecordContext(t0_ns=t0["t"], is_chat=False)
    rows = [dataclasses.asdict(to_rows(raw, 3, ctx)[0]) for raw in results]
    return Outcome(rows, results)


async def mock_and_proxy(config: MockConfig = FAST, *, seed: int = 0):
    runner, base_url = await start_mock(config)
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    proxy = FaultProxy("127.0.0.1", port, seed=seed)
    await proxy.start()
    return runner, port, proxy


def run(test, loop: str = "asyncio", config: MockConfig = FAST, *, seed: int = 0):
    """Run `test(proxy, mock_port)` with the mock and a started proxy in front of it."""

    async def main():
        runner, port, proxy = await mock_and_proxy(config, seed=seed)
        try:
            return await test(proxy, port)
        finally:
            await proxy.stop()
            await runner.cleanup()

    return RUNNERS[loop](main())


@pytest.mark.parametrize("loop", RUNNERS)
def test_idle_proxy_forwards_every_byte(loop):
    async def test(proxy, mock_port):
        direct, proxied = await drive(mock_port, 4), await drive(proxy.url_port, 4)
        await asyncio.sleep(0.1)  # the client closed its pool: the proxy closes both ends
        return direct, proxied, proxy.stats

    direct, proxied, stats = run(test, loop)
    assert proxied.classes() == {("ok", None)}
    assert [r["output_sha256"] for r in proxied.rows] == [r["output_sha256"] for r in direct.rows]
    assert stats["accepted"] == 4 and stats["open"] == 0
    assert stats["bytes_upstream"] > 0 and stats["bytes_downstream"] > 0


@pytest.mark.serial
@pytest.mark.parametrize(
    ("direction", "low_ms", "high_ms"),
    [("downstream", 150, 400), ("upstream", 150, 400), ("both", 350, 650)],
)
def test_latency_adds_to_ttft(direction, low_ms, high_ms):
    async def test(proxy, mock_port):
        base = await drive(proxy.url_port, 4)
        proxy.set_toxics([Toxic("latency", direction, params={"latency_ms": 200})])
        slow = await drive(proxy.url_port, 4)
        return base, slow

    base, slow = run(test)
    assert slow.classes() == {("ok", None)}
    added_ms = slow.ttft_ms() - base.ttft_ms()
    assert low_ms <= added_ms <= high_ms, f"latency added {added_ms:.0f} ms"


def test_latency_with_jitter_keeps_the_stream_in_order():
    async def test(proxy, mock_port):
        direct = await drive(mock_port, 4, max_tokens=32)
        proxy.set_toxics([Toxic("latency", params={"latency_ms": 20, "jitter_ms": 20})])
        return direct, await drive(proxy.url_port, 4, max_tokens=32)

    direct, jittered = run(test, config=MockConfig(ttft_ms=5, itl_ms=1))
    assert jittered.classes() == {("ok", None)}  # a reordered SSE stream would not parse
    assert [r["output_sha256"] for r in jittered.rows] == [r["output_sha256"] for r in direct.rows]


@pytest.mark.parametrize("loop", RUNNERS)
def test_reset_peer_is_connection_reset(loop):
    async def test(proxy, mock_port):
        proxy.set_toxics([Toxic("reset_peer")])
        at_once = await drive(proxy.url_port, 3)
        # 64 tokens 20 ms apart take 1.3 s; the RST comes 250 ms in, after the first tokens
        # even on a loaded machine (at 60 ms in and 5 ms apart, a busy loop missed them).
        proxy.set_toxics([Toxic("reset_peer", params={"timeout_ms": 250})])
        mid_stream = await drive(proxy.url_port, 3, max_tokens=64)
        return at_once, mid_stream, proxy.stats

    at_once, mid_stream, stats = run(test, loop, config=MockConfig(ttft_ms=5, itl_ms=20))
    assert at_once.classes() == {("unknown", "connection_reset")}
    assert all(r["num_chunks"] == 0 for r in at_once.rows)
    assert mid_stream.classes() == {("unknown", "connection_reset")}
    assert all(0 < r["num_chunks"] < 64 for r in mid_stream.rows)  # cut after some tokens
    assert stats["reset"] == 6


def test_stall_past_the_client_timeout_is_a_timeout():
    async def test(proxy, mock_port):
        proxy.set_toxics([Toxic("stall")])
        return await drive(proxy.url_port, 3, timeout_s=0.3)

    stalled = run(test)
    assert stalled.classes() == {("timeout", "timeout")}
    assert all(r["t_done_ns"] - r["t_sent_ns"] < 1e9 for r in stalled.rows)


@pytest.mark.parametrize("loop", RUNNERS)
def test_removing_a_stall_resumes_forwarding(loop):
    async def test(proxy, mock_port):
        proxy.set_toxics([Toxic("stall", "both")])
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, proxy.set_toxics, [])
        return await drive(proxy.url_port, 2)

    resumed = run(test, loop)
    assert resumed.classes() == {("ok", None)}
    assert resumed.ttft_ms() >= 290


@pytest.mark.parametrize(
    ("direction", "num_bytes", "has_chunks"),
    [("downstream", 400, True), ("downstream", 0, False), ("upstream", 40, False)],
)
def test_limit_data_cuts_the_connection(direction, num_bytes, has_chunks):
    async def test(proxy, mock_port):
        proxy.set_toxics([Toxic("limit_data", direction, params={"bytes": num_bytes})])
        return await drive(proxy.url_port, 3), proxy.stats

    cut, stats = run(test)
    # A cut HTTP body is a payload error or a disconnect to aiohttp: connection_reset, with
    # whatever events had arrived kept; never incomplete_stream (that needs a complete body).
    assert cut.classes() == {("unknown", "connection_reset")}
    assert all((r["num_chunks"] > 0) == has_chunks for r in cut.rows)
    assert stats["limited"] == 3
    assert stats[f"bytes_{direction}"] == 3 * num_bytes


@pytest.mark.parametrize("loop", RUNNERS)
def test_down_refuses_new_connections_and_recovers(loop):
    async def test(proxy, mock_port):
        options = ClientOptions(base_url=f"http://127.0.0.1:{proxy.url_port}/v1", model="mock")
        async with AiohttpTransport(options, max_connections=2) as pooled:
            first = await drive(proxy.url_port, 1, transport=pooled)  # leaves an idle connection
            proxy.set_toxics([Toxic("down")])
            down_new = await drive(proxy.url_port, 2)
            down_pooled = await drive(proxy.url_port, 1, transport=pooled)
        proxy.set_toxics([])
        back = await drive(proxy.url_port, 2)
        return first, down_new, down_pooled, back

    first, down_new, down_pooled, back = run(test, loop)
    assert first.classes() == back.classes() == {("ok", None)}
    assert down_new.classes() == {("error", "connection_refused")}
    # The pooled connection was reset (reset_open=1), and the client's new connect is refused.
    assert down_pooled.classes() <= {
        ("error", "connection_refused"),
        ("unknown", "connection_reset"),
    }


def test_down_without_reset_open_keeps_open_connections():
    async def test(proxy, mock_port):
        options = ClientOptions(base_url=f"http://127.0.0.1:{proxy.url_port}/v1", model="mock")
        async with AiohttpTransport(options, max_connections=1) as pooled:
            await drive(proxy.url_port, 1, transport=pooled)
            proxy.set_toxics([Toxic("down", params={"reset_open": 0})])
            return await drive(proxy.url_port, 1, transport=pooled), await drive(proxy.url_port, 1)

    pooled, new = run(test)
    assert pooled.classes() == {("ok", None)}
    assert new.classes() == {("error", "connection_refused")}


def test_fraction_picks_the_same_connections_for_a_seed():
    toxic = Toxic("reset_peer", fraction=0.5)

    async def test(proxy, mock_port):
        proxy.set_toxics([toxic])
        outcome = await drive(proxy.url_port, 40, concurrency=1, fresh=True)
        return {r["request_id"] for r in outcome.rows if r["status"] != "ok"}, outcome

    quick = MockConfig(ttft_ms=1, itl_ms=0)
    first, outcome = run(test, config=quick, seed=11)
    again, _ = run(test, config=quick, seed=11)
    other, _ = run(test, config=quick, seed=12)
    assert outcome.classes() == {("ok", None), ("unknown", "connection_reset")}
    assert 10 <= len(first) <= 30
    assert first == again
    assert first != other
    expected = {f"r{i:02d}" for i in range(40) if toxic.is_chosen(11, i)}
    assert first == expected


def test_toxic_meets_connections_already_open():
    async def test(proxy, mock_port):
        options = ClientOptions(base_url=f"http://127.0.0.1:{proxy.url_port}/v1", model="mock")
        async with AiohttpTransport(options, max_connections=1) as pooled:
            before = await drive(proxy.url_port, 1, transport=pooled)
            proxy.set_toxics([Toxic("reset_peer")])
            during = await drive(proxy.url_port, 1, transport=pooled)
            proxy.set_toxics([])
            after = await drive(proxy.url_port, 1, transport=pooled)
        return before, during, after, proxy.stats["accepted"]

    before, during, after, accepted = run(test)
    assert before.classes() == after.classes() == {("ok", None)}
    assert during.classes() == {("unknown", "connection_reset")}
    assert accepted == 2  # the reset connection was replaced once


@pytest.mark.serial
def test_bandwidth_caps_a_large_response():
    rate_kbps = 4000.0  # 500,000 bytes/s

    async def test(proxy, mock_port):
        direct = await drive(mock_port, 1, stream=False, max_tokens=20_000)
        proxy.set_toxics([Toxic("bandwidth", params={"rate_kbps": rate_kbps})])
        return direct, await drive(proxy.url_port, 1, stream=False, max_tokens=20_000)

    direct, capped = run(test, config=MockConfig(ttft_ms=0, itl_ms=0))
    assert capped.classes() == {("ok", None)}
    size = len(capped.raws[0].body)
    floor_s = size / (rate_kbps * 125)
    elapsed = [(r["t_done_ns"] - r["t_sent_ns"]) / 1e9 for r in (direct.rows[0], capped.rows[0])]
    assert size > 100_000 and elapsed[0] < floor_s / 2
    assert floor_s <= elapsed[1] < floor_s * 2 + 0.5


def test_slicer_delivers_the_same_bytes_in_smaller_reads():
    async def test(proxy, mock_port):
        whole = await drive(proxy.url_port, 1, max_tokens=16)
        slicer = {"average_size": 16, "size_variation": 4, "delay_us": 500}
        proxy.set_toxics([Toxic("slicer", params=slicer)])
        return whole, await drive(proxy.url_port, 1, max_tokens=16)

    whole, sliced = run(test, config=MockConfig(ttft_ms=5, itl_ms=0))
    assert sliced.classes() == {("ok", None)}
    assert sliced.rows[0]["output_sha256"] == whole.rows[0]["output_sha256"]
    whole_reads = [len(data) for _, data in whole.raws[0].reads]
    sliced_reads = [len(data) for _, data in sliced.raws[0].reads]
    assert sum(sliced_reads) == sum(whole_reads)
    assert len(sliced_reads) > 3 * len(whole_reads)
    assert statistics.median(sliced_reads) <= 20


def test_stop_closes_links_in_flight():
    async def test(proxy, mock_port):
        proxy.set_toxics([Toxic("stall")])
        task = asyncio.create_task(drive(proxy.url_port, 2, timeout_s=5))
        await asyncio.sleep(0.2)
        open_links = proxy.stats["open"]
        t = time.perf_counter()
        await proxy.stop()
        outcome = await task
        return open_links, time.perf_counter() - t, outcome

    open_links, stop_s, outcome = run(test)
    assert open_links == 2 and stop_s < 1.0
    assert outcome.classes() == {("unknown", "connection_reset")}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "jam"}, "kind"),
        ({"kind": "latency", "direction": "sideways", "params": {"latency_ms": 1}}, "direction"),
        ({"kind": "stall", "fraction": 1.5}, "fraction"),
        ({"kind": "down", "fraction": 0.5}, "fraction"),
        ({"kind": "latency"}, "latency_ms"),
        ({"kind": "latency", "params": {"latency_ms": -1}}, "latency_ms"),
        ({"kind": "latency", "params": {"latency_ms": 5, "jitter_ms": -1}}, "jitter_ms"),
        ({"kind": "latency", "params": {"latency_ms": 5, "delay_ms": 1}}, "delay_ms"),
        ({"kind": "bandwidth", "params": {"rate_kbps": 0}}, "rate_kbps"),
        ({"kind": "bandwidth", "params": {"rate_kbps": float("nan")}}, "rate_kbps"),
        ({"kind": "slicer", "params": {"average_size": 0}}, "average_size"),
        ({"kind": "slicer", "params": {"average_size": 4, "size_variation": 4}}, "size_variation"),
        ({"kind": "slicer", "params": {"average_size": 4, "delay_us": -1}}, "delay_us"),
        ({"kind": "reset_peer", "params": {"timeout_ms": -5}}, "timeout_ms"),
        ({"kind": "limit_data", "params": {"bytes": True}}, "bytes"),
        ({"kind": "down", "params": {"reset_open": 2}}, "reset_open"),
        ({"kind": "stall", "params": None}, "params"),
    ],
)
def test_bad_toxic_is_one_sentence_naming_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        Toxic(**kwargs)
    message = str(info.value)
    assert field in message
    assert "\n" not in message and message.endswith(".")


def test_two_toxics_of_one_kind_and_direction_are_refused():
    proxy = FaultProxy("127.0.0.1", 1)
    latency = {"latency_ms": 5}
    with pytest.raises(ValueError, match="two latency toxics act downstream"):
        proxy.set_toxics(
            [Toxic("latency", params=latency), Toxic("latency", "both", params=latency)]
        )
    proxy.set_toxics(
        [Toxic("latency", params=latency), Toxic("latency", "upstream", params=latency)]
    )


def test_toxic_defaults_and_kinds():
    assert set(TOXIC_KINDS) == {
        "latency",
        "bandwidth",
        "slicer",
        "stall",
        "reset_peer",
        "limit_data",
        "down",
    }
    toxic = Toxic("latency", params={"latency_ms": 5})
    assert dict(toxic.params) == {"latency_ms": 5.0, "jitter_ms": 0.0}
    assert toxic == Toxic("latency", params={"latency_ms": 5.0, "jitter_ms": 0})
    assert hash(toxic) == hash(Toxic("latency", params={"jitter_ms": 0, "latency_ms": 5}))


class _GoneTransport:
    """A receiver that disconnected just before its FIN could be passed on."""

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        raise OSError(107, "Transport endpoint is not connected")


class _Owner:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def reset(self, by_toxic: bool) -> None:
        self.calls.append("reset")

    def close(self, *, limited: bool) -> None:
        self.calls.append("close")

    def half_closed(self) -> None:
        self.calls.append("half_closed")

    def forwarded(self, direction: str, num_bytes: int) -> None:
        pass


@pytest.mark.parametrize("latency", [False, True], ids=["direct", "queued"])
def test_a_fin_for_a_receiver_already_gone_closes_the_connection_quietly(latency):
    """Passing the server's FIN on to a client that just disconnected raised ENOTCONN inside
    the pipe's writer task ("Task exception was never retrieved"); it now closes both sides."""
    from types import SimpleNamespace

    from faults.toxics import ToxicPipe

    async def main() -> list[str]:
        owner = _Owner()
        src, dst = SimpleNamespace(transport=None), SimpleNamespace(transport=_GoneTransport())
        pipe = ToxicPipe(owner, "downstream", src, dst, random.Random(0))
        if latency:
            pipe.set_toxics([Toxic("latency", "downstream", 1.0, {"latency_ms": 5.0})])
        pipe.update_gate()
        pipe.feed_eof()
        await asyncio.sleep(0.05)
        writer = pipe.writer
        pipe.stop()
        if writer is not None:  # the queued path: its writer task must not have died of it
            await asyncio.sleep(0)
            assert not writer.done() or writer.cancelled() or writer.exception() is None
        return owner.calls

    assert asyncio.run(main()) == ["close"]
