"""Client capacity: how many streamed tokens per second `bench run` ingests while recording all.

Setup (issue "Foundation"): `../shared/tools/mock_openai.py` pinned to core 1, `bench run` pinned
to core 0; 200 requests x 16 prompt tokens x 1,024 output tokens, 64 concurrent, completions.
The figure is output tokens of ok requests over the span from the first send to the last
completion, read back from `requests.parquet`; chunks recorded are checked against it.

    python benchmarks/client_capacity.py [--repeats 3] [--mock PATH]

Each repeat also runs a bare reader (aiohttp + uvloop, splits events and takes a timestamp per
read, keeps only counts, records nothing to disk: the ceiling for this client stack) under the same pinning, so
the ratio harness / bare reader is measured side by side on this noisy machine.

    python benchmarks/client_capacity.py --sustained [--num-requests 15000] [--repeats 1]

`--sustained` (issue "Load generation at scale"): 15,000 requests of 1,024 tokens by default,
and in each repeat the same run twice as long; besides tokens/s it reports the `bench run`
process's resident memory: the peak while the load ran (sampled every 0.05 s from
`/proc/PID/status`, the load window read from the run's own records: its t0 is
CLOCK_MONOTONIC, the clock this script samples with) and the peak over the whole process (the
summary and card included: its `VmHWM`), with the bare reader's tokens/s and peak
memory on the same requests beside them. Issue "Runs that last" asks for a process peak under
600 MB and the 2x run's within 10% of it (the summary holds the run's chunk gaps within
`--memory-budget-mb`, exact while they fit and a sketch beyond: `slo.sketch`); each run's
pooled ITL percentiles in summary.json are checked against the exact ones computed here
from chunks.parquet, within the relative error the summary states.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
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
        counts = {"events": 0, "last_ns": 0}  # stamps are taken per read, kept as a count
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
                            counts["events"] += sum(1 for e in events if e.startswith(b"data: {"))
                            counts["last_ns"] = t

            t0 = time.perf_counter()
            await asyncio.gather(*(user() for _ in range(concurrency)))
            elapsed = time.perf_counter() - t0
        tokens = counts["events"] - num_requests  # each stream's last JSON event is the usage chunk
        return tokens / elapsed

    return uvloop.run(main())


def run_sampled(cmd: list[str], *, capture: bool = False) -> tuple[list[tuple[int, int]], int, str]:
    """Run `cmd`, sampling its resident memory every 0.2 s; returns
    ([(monotonic_ns, rss_kib)], its peak RSS in KiB, its stdout when `capture`). The peak is
    the kernel's high-water mark of the process's own memory (`VmHWM`, read until it exits),
    not wait4's ru_maxrss: that one starts from this process's RSS when it forked the child
    (the mark survives fork and exec), so a parent that had read a run's tables inflated it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if capture else subprocess.DEVNULL)
    samples: list[tuple[int, int]] = []
    high_water = 0
    status_file = Path(f"/proc/{proc.pid}/status")
    while True:
        pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            for line in status_file.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    samples.append((time.monotonic_ns(), int(line.split()[1])))
                elif line.startswith("VmHWM:"):
                    high_water = max(high_water, int(line.split()[1]))
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    stdout = proc.stdout.read().decode() if capture else ""
    if capture:
        proc.stdout.close()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited with {proc.returncode}")
    return samples, high_water, stdout


def load_window_ns(run_dir: Path) -> tuple[int, int]:
    """The load phase in CLOCK_MONOTONIC ns: t0 + first send, t0 + last done."""
    t0 = json.loads((run_dir / "manifest.json").read_text())["t0_ns"]
    req = pq.read_table(run_dir / "requests.parquet", columns=["t_sent_ns", "t_done_ns"])
    sent = [t for t in req.column("t_sent_ns").to_pylist() if t is not None]
    return t0 + min(sent), t0 + max(req.column("t_done_ns").to_pylist())


def itl_check(run_dir: Path) -> dict:
    """summary.json's pooled ITL percentiles against exact ones from chunks.parquet (this
    script holds every gap; the harness did not): the largest relative error and the bound."""
    import numpy as np

    itl = json.loads((run_dir / "summary.json").read_text())["latency_ms"]["itl"]
    req = pq.read_table(run_dir / "requests.parquet", columns=["request_id", "status"])
    ok = {r for r, s in zip(*(req.column(c).to_pylist() for c in ("request_id", "status")),
                            strict=True) if s == "ok"}  # fmt: skip
    chunks = pq.read_table(run_dir / "chunks.parquet", columns=["request_id", "t_ns", "n_tokens"])
    chunks = chunks.filter(pc.greater(chunks["n_tokens"], 0))
    encoded = chunks["request_id"].combine_chunks().dictionary_encode()
    ids = encoded.indices.to_numpy()
    ok_code = np.array([name in ok for name in encoded.dictionary.to_pylist()], bool)
    t = chunks["t_ns"].to_numpy()
    keep = (ids[1:] == ids[:-1]) & ok_code[ids[1:]]
    gaps = (t[1:] - t[:-1])[keep] / 1e6
    worst = 0.0
    for q in (50, 90, 95, 99):
        exact = float(np.percentile(gaps, q))
        got = itl[f"p{q}"]
        worst = max(worst, abs(got - exact) / exact if exact else abs(got))
    return {"itl_quantiles": itl.get("quantiles"), "itl_bound": itl.get("relative_error"),
            "itl_worst_relative_error": worst}  # fmt: skip


def measure(run_dir: Path) -> dict:
    req = pq.read_table(run_dir / "requests.parquet").to_pydict()
    chunks = pq.read_table(run_dir / "chunks.parquet", columns=["n_tokens"])
    ok = [i for i, s in enumerate(req["status"]) if s == "ok"]
    tokens = sum(req["output_tokens"][i] for i in ok)  # the chunks' counts as sums, not lists
    span_s = (max(req["t_done_ns"]) - min(t for t in req["t_sent_ns"] if t is not None)) / 1e9
    return {
        "requests": len(req["status"]),
        "ok": len(ok),
        "output_tokens": tokens,
        "chunk_rows": chunks.num_rows,
        "token_chunks": pc.sum(chunks.column("n_tokens")).as_py(),
        "span_s": span_s,
        "output_tokens_per_s": tokens / span_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mock", type=Path, default=DEFAULT_MOCK)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, help="default 200; 15,000 with --sustained")
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--sustained",
        action="store_true",
        help="long runs (default 15,000 requests, and twice that) with memory reported",
    )
    parser.add_argument("--bare-reader-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--itl-check", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.itl_check:
        print(json.dumps(itl_check(args.itl_check)))
        return
    if args.num_requests is None:
        args.num_requests = 15_000 if args.sustained else 200
    if args.bare_reader_port:
        print(
            bare_reader(args.bare_reader_port, args.num_requests, args.output_len, args.concurrency)
        )
        return
    if not args.mock.exists():
        sys.exit(f"mock server not found at {args.mock}; pass --mock PATH")
    if args.sustained:
        sustained(args)
        return

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


def harness_cmd(port: int, num_requests: int, args, out: Path, seed: int) -> list[str]:
    return [
        *taskset("0"), sys.executable, "-m", "harness.cli", "run",
        "--url", f"http://127.0.0.1:{port}/v1", "--model", "mock",
        "--workload", "random", "--input-len", "16", "--output-len", str(args.output_len),
        "--num-requests", str(num_requests), "--concurrency", str(args.concurrency),
        "--tokenizer", "tiny-random", "--seed", str(seed), "--out", str(out), "--quiet",
    ]  # fmt: skip


def sustained_harness(port: int, num_requests: int, args, seed: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="client-sustained-")) / "run"
    try:
        samples, peak_kib, _ = run_sampled(harness_cmd(port, num_requests, args, out, seed))
        figures = measure(out)
        # in a process of its own: a child's peak RSS starts from this process's (fork keeps
        # the high-water mark, exec too), so this one must stay small
        check = [sys.executable, __file__, "--itl-check", str(out)]
        figures.update(json.loads(subprocess.run(check, check=True, capture_output=True).stdout))
        start, end = load_window_ns(out)
        in_load = [rss for t, rss in samples if start <= t <= end]
        figures["load_rss_peak_mb"] = max(in_load, default=0) / 1024
        figures["process_rss_peak_mb"] = peak_kib / 1024
        return figures
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def sustained_bare(port: int, num_requests: int, args) -> dict:
    cmd = [
        *taskset("0"), sys.executable, __file__, "--bare-reader-port", str(port),
        "--num-requests", str(num_requests), "--output-len", str(args.output_len),
        "--concurrency", str(args.concurrency),
    ]  # fmt: skip
    _, peak_kib, stdout = run_sampled(cmd, capture=True)
    peak = peak_kib / 1024
    return {"tokens_per_s": float(stdout.strip()), "rss_peak_mb": peak}


def sustained(args) -> None:
    """The sustained mode: harness at N and 2N requests, bare reader at N, per repeat."""
    port = free_port()
    mock = subprocess.Popen([*taskset("1"), sys.executable, str(args.mock), str(port)])
    n = args.num_requests
    repeats = []
    try:
        wait_port(port)
        for i in range(args.repeats):
            one = sustained_harness(port, n, args, seed=i)
            bare = sustained_bare(port, n, args)
            two = sustained_harness(port, 2 * n, args, seed=i)
            row = {"harness": one, "bare_reader": bare, "harness_2x": two}
            repeats.append(row)
            for name, fig in (("run", one), ("2x run", two)):
                print(
                    f"{name}: ITL percentiles {fig['itl_quantiles']} (stated bound "
                    f"{fig['itl_bound']:.0%}), largest relative error against exact "
                    f"{fig['itl_worst_relative_error']:.2%}"
                )
            print(
                f"repeat {i}: harness {one['output_tokens_per_s']:,.0f} tok/s over "
                f"{one['output_tokens']:,} tokens ({one['ok']}/{one['requests']} ok), RSS in load "
                f"{one['load_rss_peak_mb']:.0f} MB, process peak {one['process_rss_peak_mb']:.0f} MB; "
                f"bare reader {bare['tokens_per_s']:,.0f} tok/s, peak {bare['rss_peak_mb']:.0f} MB; "
                f"2x run {two['output_tokens_per_s']:,.0f} tok/s, RSS in load "
                f"{two['load_rss_peak_mb']:.0f} MB, process peak {two['process_rss_peak_mb']:.0f} MB"
            )
    finally:
        mock.terminate()
        mock.wait(timeout=10)

    def median(path: tuple[str, str]) -> float:
        values = sorted(r[path[0]][path[1]] for r in repeats)
        return values[len(values) // 2]

    tps = median(("harness", "output_tokens_per_s"))
    bare_tps = median(("bare_reader", "tokens_per_s"))
    load, load2 = (
        median(("harness", "load_rss_peak_mb")),
        median(("harness_2x", "load_rss_peak_mb")),
    )
    peak, peak2 = (median(("harness", "process_rss_peak_mb")),
                   median(("harness_2x", "process_rss_peak_mb")))  # fmt: skip
    print(
        f"median over {len(repeats)}: harness {tps:,.0f} output tokens/s (target >= 1,500,000), "
        f"bare reader {bare_tps:,.0f} (ratio {tps / bare_tps:.2f}); RSS while loading {load:.0f} MB "
        f"(target < 600), 2x run {load2:.0f} MB (ratio {load2 / load:.2f}, target within 1.10); "
        f"process peak {peak:.0f} MB (target < 600), 2x run {peak2:.0f} MB (ratio "
        f"{peak2 / peak:.2f}, target within 1.10)"
    )
    if args.json:
        args.json.write_text(json.dumps({"repeats": repeats}, indent=2))


if __name__ == "__main__":
    main()
