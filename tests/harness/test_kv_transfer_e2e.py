"""A P/D cluster's per-request figures end to end: `bench run --url` against a small OpenAI-like
server (in a thread, over loopback) whose streamed answers carry `usage.kv_transfer` and the
`x-bench-worker` header as the reference engine's P/D router sends them, then `bench report`:
the run records, the summary's `disaggregation` block and the card (console, JSON, HTML).

Answers 0..3 (in the order the server answered them) hand off (i + 1) * 250,000 bytes in
(i + 1) * 2.5 ms after a prefill of 10 + i ms, install 0.5 ms, on decode-(i % 2); answer 4
carries garbage in every field. Every answer's header names `hdr-<i>`, which only answer 4
(no decode worker named) records. By hand: 2,500,000 bytes / 25 ms = 100 MB/s over 4
handoffs, all ok; workers decode-0 2, decode-1 2, hdr-4 1."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import queue
import threading
from collections.abc import Iterator

import pyarrow.parquet as pq
import pytest
from aiohttp import web
from click.testing import CliRunner

from harness.cli import bench

N = 5
FAST = ["--workload", "random", "--tokenizer", "tiny-random", "--input-len", "8",
        "--output-len", "3", "--num-requests", str(N), "--quiet"]  # fmt: skip


def _transfer(i: int) -> dict:
    if i == N - 1:
        return {"bytes": "many", "transfer_ms": -1, "ok": "yes", "prefill_ms": True,
                "install_ms": [0.5], "worker": 7, "retried": 3}  # fmt: skip
    return {"transfer_id": f"t{i}", "ok": True, "error": None, "bytes": (i + 1) * 250_000,
            "transfer_ms": (i + 1) * 2.5, "prefill_ms": 10.0 + i, "install_ms": 0.5,
            "worker": "prefill-0", "decode_worker": f"decode-{i % 2}", "retried": None}  # fmt: skip


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    i = next(request.app[_ANSWERED])
    n = int(body.get("max_tokens") or 3)
    usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n,
             "kv_transfer": _transfer(i)}  # fmt: skip
    headers = {"Content-Type": "text/event-stream", "x-bench-worker": f"hdr-{i}"}
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    for k in range(n):
        choice = {"index": 0, "text": f" w{k}", "finish_reason": "length" if k == n - 1 else None}
        await response.write(b"data: " + json.dumps({"id": f"c{i}", "choices": [choice]}).encode()
                             + b"\n\n")  # fmt: skip
    if (body.get("stream_options") or {}).get("include_usage"):
        event = {"id": f"c{i}", "choices": [], "usage": usage}
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "pd-test", "object": "model"}]})


_ANSWERED = web.AppKey("answered", itertools.count)


async def _serve(ready: queue.Queue) -> None:
    app = web.Application()
    app[_ANSWERED] = itertools.count()  # the answer's index, in answering order
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app, shutdown_timeout=0.2, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    stop = asyncio.Event()
    ready.put((runner.addresses[0][1], asyncio.get_running_loop(), stop))
    await stop.wait()
    await runner.cleanup()


@contextlib.contextmanager
def _serving() -> Iterator[str]:
    ready: queue.Queue = queue.Queue()
    thread = threading.Thread(target=lambda: asyncio.run(_serve(ready)), daemon=True)
    thread.start()
    port, loop, stop = ready.get(timeout=10)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("pd") / "run"
    with _serving() as url:
        result = CliRunner().invoke(bench, ["run", "--url", url, *FAST, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_the_run_records_carry_each_answers_figures(run_dir):
    rows = pq.read_table(run_dir / "requests.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok"] * N
    got = sorted(
        ((r["kv_transfer_bytes"], r["kv_transfer_ms"], r["kv_prefill_ms"], r["kv_install_ms"],
          r["kv_transfer_ok"], r["kv_transfer_retried"], r["served_by"]) for r in rows),
        key=repr,
    )  # fmt: skip
    assert got == sorted(
        [(250_000, 2.5, 10.0, 0.5, True, None, "decode-0"),
         (500_000, 5.0, 11.0, 0.5, True, None, "decode-1"),
         (750_000, 7.5, 12.0, 0.5, True, None, "decode-0"),
         (1_000_000, 10.0, 13.0, 0.5, True, None, "decode-1"),
         (None, None, None, None, None, None, "hdr-4")],
        key=repr,
    )  # fmt: skip


def test_the_summary_and_the_card_show_the_bandwidth(run_dir, tmp_path):
    block = json.loads((run_dir / "summary.json").read_text())["disaggregation"]
    assert (block["requests_with_transfer"], block["transfers_ok"], block["transfers_failed"]) == (
        4, 4, 0
    )  # fmt: skip
    assert (block["total_transfer_bytes"], block["total_transfer_ms"]) == (2_500_000, 25.0)
    assert block["effective_bandwidth_mb_per_s"] == pytest.approx(100.0)
    assert block["requests_by_worker"] == {"decode-0": 2, "decode-1": 2, "hdr-4": 1}
    card_json, html = tmp_path / "card.json", tmp_path / "card.html"
    result = CliRunner().invoke(
        bench, ["report", str(run_dir), "--json", str(card_json), "-o", str(html)]
    )
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "Effective link bandwidth: 100.000 MB/s" in flat
    assert "2,500,000 bytes / 25.000 ms over 4 handoff(s)" in flat
    assert "Requests per serving worker: decode-0 2, decode-1 2, hdr-4 1." in flat
    card = json.loads(card_json.read_text())
    assert card["disaggregation"]["effective_bandwidth_mb_per_s"] == 100.0
    assert "Effective link bandwidth: 100.000 MB/s" in html.read_text()
