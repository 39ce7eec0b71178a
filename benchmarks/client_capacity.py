"""Client capacity: how many streamed tokens per second `bench run` ingests while recording all.

Setup (issue "Foundation"): `../shared/tools/mock_openai.py` pinned to core 1, `bench run` pinned
to core 0; 200 requests x 16 prompt tokens x 1,024 output tokens, 64 concurrent, completions.
The figure is output tokens of ok requests over the span from the first send to the last
completion, read back from `requests.parquet`; chunks recorded are checked against it.

    python benchmarks/client_capacity.py [--repeats 3] [--mock PATH]

Each repeat also runs a bare reader (aiohttp + uvloop, splits events and keeps a timestamp per
event, records nothing to disk: the ceiling for this client stack) under the same pinning, so
the ratio harness / bare reader is measured side by side on this noisy machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MOCK = REPO.parent / "shared" / "tools" / "mock_openai.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def taskset(core: str) -> list[str]:
    return ["taskset", "-c", core] if shutil.which("taskset") else []


def wait_port(port: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError("mock server did not start")


def bare_reader(port: int, num_requests: int, output_len: int, concurrency: int) -> float:
    """The baseline: stream every response, split SSE events, stamp each; return tokens/s."""
    import asyncio

    import aiohttp
    import uvloop

    body = json.dumps(
        {"model": "mock", "prompt": "x " * 16, "max_tokens": output_len, "stream": True}
    ).encode()
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def main() -> float:
        queue = list(range(num_requests))
        stamps: list[int] = []
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def user() -> None:
                while queue:
                    queue.pop()
                    async with session.post(
                        url, data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        buf = b""
                        while data := await r.content.readany():
                            t = time.perf_counter_ns()
                            buf += data
                            *events, buf = buf.split(b"\n\n")
                            stamps.extend(t for e in events if e.startswith(b"data: {"))

            t0 = time.perf_counter()
            await asyncio.gather(*(user() for _ in range(concurrency)))
            elapsed = time.perf_counter() - t0
        tokens = len(stamps) - num_requests  # each stream's last JSON event is the usage chunk
        return tokens / elapsed

    return uvloop.run(main())


def measure(run_dir: Path) -> dict:
    req = pq.read_table(run_dir / "requests.parquet").to_pydict()
    chunks = pq.read_table(run_dir / "chunks.parquet", columns=["n_tokens"])
    ok = [i for i, s in enumerate(req["status"]) if s == "ok"]
    tokens = sum(req["output_tokens"][i] for i in ok)
    span_s = (max(req["t_done_ns"]) - min(t for t in req["t_sent_ns"] if t is not None)) / 1e9
    return {
        "requests": len(req["status"]),
        "ok": len(ok),
        "output_tokens": tokens,
        "chunk_rows": chunks.num_rows,
        "token_chunks": sum(chunks.column("n_tokens").to_pylist()),
        "span_s": span_s,
        "output_tokens_per_s": tokens / span_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mock", type=Path, default=DEFAULT_MOCK)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--bare-reader-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_reader_port:
        print(
            bare_reader(args.bare_reader_port, args.num_requests, args.output_len, args.concurrency)
        )
        return
    if not args.mock.exists():
        sys.exit(f"mock server not found at {args.mock}; pass --mock PATH")

    port = free_port()
    mock = subprocess.Popen([*taskset("1"), sys.executable, str(args.mock), str(port)])
    results = []
    try:
        wait_port(port)
        for i in range(args.repeats):
            out = Path(tempfile.mkdtemp(prefix="client-capacity-")) / "run"
            cmd = [
                *taskset("0"), sys.executable, "-m", "harness.cli", "run",
                "--url", f"http://127.0.0.1:{port}/v1", "--model", "mock",
                "--workload", "random", "--input-len", "16", "--output-len", str(args.output_len),
                "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency),
                "--tokenizer", "tiny-random", "--seed", str(i), "--out", str(out), "--quiet",
            ]  # fmt: skip
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            figures = measure(out)
            bare_cmd = [
                *taskset("0"), sys.executable, __file__, "--bare-reader-port", str(port),
                "--num-requests", str(args.num_requests), "--output-len", str(args.output_len),
                "--concurrency", str(args.concurrency),
            ]  # fmt: skip
            bare = subprocess.run(bare_cmd, check=True, capture_output=True, text=True)
            figures["bare_reader_tokens_per_s"] = float(bare.stdout.strip())
            figures["ratio_to_bare"] = (
                figures["output_tokens_per_s"] / figures["bare_reader_tokens_per_s"]
            )
            results.append(figures)
            print(
                f"run {i}: harness {figures['output_tokens_per_s']:,.0f} output tokens/s "
                f"({figures['ok']}/{figures['requests']} ok, {figures['chunk_rows']:,} chunk rows, "
                f"{figures['span_s']:.3f} s); bare reader {figures['bare_reader_tokens_per_s']:,.0f}; "
                f"ratio {figures['ratio_to_bare']:.2f}"
            )
            shutil.rmtree(out.parent, ignore_errors=True)
    finally:
        mock.terminate()
        mock.wait(timeout=10)

    def median(key: str) -> float:
        values = sorted(r[key] for r in results)
        return values[len(values) // 2]

    print(
        f"median over {len(results)} runs: harness {median('output_tokens_per_s'):,.0f} output tokens/s "
        f"(target >= 500,000); bare reader {median('bare_reader_tokens_per_s'):,.0f}; "
        f"ratio harness/bare {median('ratio_to_bare'):.2f}"
    )
    if args.json:
        figures = {"runs": results, "median_output_tokens_per_s": median("output_tokens_per_s")}
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
