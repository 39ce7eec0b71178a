"""Proxy overhead: TTFT of bench-style streaming requests to the mock server, direct and through
the idle fault proxy (`faults.proxy.FaultProxy`, no toxic active).

Setup: `bench mock-server --ttft-ms 20 --itl-ms 5` in its own process; the client (the harness's
`AiohttpTransport` driven by `run_load`, on uvloop as `bench run` runs) and the proxy share one
event loop, as when `bench run` starts the proxy itself. Each run sends `--num-requests`
completions (8 prompt words, 16 output tokens, streamed) at `--request-rate` per second after a
short warm-up; direct and proxied runs alternate, the first of each round swapping, so drift on
this noisy machine falls on both. TTFT is send to first token-bearing chunk, from the records.

    python benchmarks/proxy_overhead.py [--rounds 5] [--num-requests 100] [--request-rate 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import uvloop

from faults.proxy import FaultProxy
from harness.http.client import AiohttpTransport, ClientOptions, RequestPayload, build_body
from harness.load.loadgen import LoadPlan, run_load
from harness.load.records import RecordContext, to_rows


def start_mock(ttft_ms: float, itl_ms: float) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "harness.cli", "mock-server", "--port", "0"]
    cmd += ["--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        if match := re.search(r"listening on http://127\.0\.0\.1:(\d+)", line):
            return proc, int(match.group(1))
    proc.kill()
    raise RuntimeError("the mock server did not start")


async def measure_run(port: int, num_requests: int, rate: float) -> np.ndarray:
    """TTFT in ms of every measured request of one run against 127.0.0.1:`port`."""
    options = ClientOptions(base_url=f"http://127.0.0.1:{port}/v1", model="mock", timeout_s=30)
    spec = {"prompt": " ".join(["word"] * 8), "max_output_tokens": 16, "ignore_eos": True}
    body = build_body(options, spec)
    payloads = [RequestPayload(f"r{i}", body) for i in range(num_requests)]
    warmup = [RequestPayload(f"w{i}", body, is_warmup=True) for i in range(4)]
    plan = LoadPlan(payloads, [i / rate for i in range(num_requests)], warmup=warmup)
    results, t0 = [], {}
    async with AiohttpTransport(options, max_connections=64) as transport:
        await run_load(
            transport, plan, results.append, start_callback=lambda t: t0.setdefault("t", t)
        )
    ctx = RecordContext(t0_ns=t0["t"], is_chat=False)
    ttft = []
    for raw in results:
        record = dataclasses.asdict(to_rows(raw, 8, ctx)[0])
        if record["is_warmup"]:
            continue
        if record["status"] != "ok":
            raise RuntimeError(f"request {record['request_id']} failed: {record['error_class']}")
        ttft.append((record["t_first_token_ns"] - record["t_sent_ns"]) / 1e6)
    return np.array(ttft)


async def benchmark(mock_port: int, rounds: int, num_requests: int, rate: float) -> list[dict]:
    rows = []
    async with FaultProxy("127.0.0.1", mock_port) as proxy:
        targets = {"direct": mock_port, "proxy": proxy.url_port}
        for i in range(rounds):
            order = ["direct", "proxy"] if i % 2 == 0 else ["proxy", "direct"]
            row = {"round": i}
            for name in order:
                ttft = await measure_run(targets[name], num_requests, rate)
                row[f"{name}_p50"] = float(np.percentile(ttft, 50))
                row[f"{name}_p99"] = float(np.percentile(ttft, 99))
            rows.append(row)
            print(
                f"round {i} ({order[0]} first): direct p50 {row['direct_p50']:7.3f}  "
                f"p99 {row['direct_p99']:7.3f} | proxy p50 {row['proxy_p50']:7.3f}  "
                f"p99 {row['proxy_p99']:7.3f} ms",
                flush=True,
            )
        print(f"proxy stats: {proxy.stats}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=50.0)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=5.0)
    args = parser.parse_args()

    mock, port = start_mock(args.ttft_ms, args.itl_ms)
    try:
        rows = uvloop.run(benchmark(port, args.rounds, args.num_requests, args.request_rate))
    finally:
        mock.terminate()
        mock.wait(timeout=10)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"\nmedian over {len(rows)} rounds ({args.num_requests} requests each), TTFT ms:")
    print(f"{'':8}{'direct':>10}{'proxy':>10}{'added':>10}")
    for q in ("p50", "p99"):
        direct, proxied = median(f"direct_{q}"), median(f"proxy_{q}")
        print(f"{q:8}{direct:10.3f}{proxied:10.3f}{proxied - direct:+10.3f}")
    paired = [r["proxy_p50"] - r["direct_p50"] for r in rows]
    print(f"p50 added, per round: {', '.join(f'{d:+.3f}' for d in paired)} ms")


if __name__ == "__main__":
    main()
