"""W4A16 single-stream decode against llama.cpp on the same Q4_1 file, side by side.

Every configuration is one `bench run --concurrency 1` against a server the harness starts
(the path a user takes), on the same hash-pinned workload; each round runs every
configuration once, in an order rotated per round, and the medians over rounds are reported
with each round's figures. Configurations:

- `llamacpp`: llama-cpp-python serving the GGUF file (`--target llamacpp`, 2 threads, the
  harness's default launch), the anchor;
- `ref-w4a16`: the reference engine with `--quantization w4a16` (the engine's own int4
  kernels and fused decode layer where they build);
- `ref-w4a16-torch`: the same with `BENCH_REF_KERNELS=0`: torch's int4 kernel and the Python
  layers (the engine before those kernels);
- `ref-float32`: the reference engine unquantized (optional).

Figures per run: TPOT p50 and ITL p50 (ms, from `summary.json`), output tokens/s, the TPOT
of the run's first three requests (llama.cpp's later requests slowed down on this machine),
and the server's RSS: the sum over the processes `bench run` started (the server and any engine
process), sampled from /proc every 0.2 s; the median (mostly serving) and the peak (loading
included). `--kv-cache-bytes` sizes the reference engine's KV pool (default 400 MiB: 8,192
float32 tokens of SmolLM2, as llama.cpp's `--n_ctx 8192` holds in float16).

    python benchmarks/w4a16_vs_llamacpp.py --llamacpp-python /work/llamacpp-venv/bin/python
    python benchmarks/w4a16_vs_llamacpp.py --configs ref-w4a16,ref-w4a16-torch --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from engine_ref.core import kernels

CONFIGS = ("llamacpp", "ref-w4a16", "ref-w4a16-torch", "ref-float32")


def command(config: str, args: argparse.Namespace, out: Path) -> tuple[list[str], dict]:
    cmd = [
        sys.executable, "-m", "harness.cli", "run",
        "--model", args.model,
        "--workload", "random",
        "--input-len", str(args.input_len),
        "--output-len", str(args.output_len),
        "--num-requests", str(args.num_requests),
        "--concurrency", "1",
        "--ignore-eos",
        "--seed", str(args.seed),
        "--startup-timeout", "600",
        "--quiet",
        "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ)
    if config == "llamacpp":
        cmd += ["--target", "llamacpp", "--engine-python", f"llamacpp={args.llamacpp_python}"]
    else:
        cmd += ["--server-arg=--num-threads", f"--server-arg={args.threads}"]
        cmd += ["--server-arg=--kv-cache-memory-bytes", f"--server-arg={args.kv_cache_bytes}"]
        if config.startswith("ref-w4a16"):
            cmd += ["--server-arg=--quantization", "--server-arg=w4a16"]
        if config == "ref-w4a16-torch":
            env["BENCH_REF_KERNELS"] = "0"
    return cmd, env


def figures(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    latency = summary["latency_ms"]
    row = {
        "tpot_p50_ms": latency["tpot"]["p50"],
        "itl_p50_ms": latency["itl"]["p50"],
        "ttft_p50_ms": latency["ttft"]["p50"],
        "output_tok_s": summary["throughput"].get("output_tokens_per_s"),
        "ok": summary["counts"]["by_status"]["ok"],
        "requests": summary["counts"]["total"],
    }
    requests = pq.read_table(out / "requests.parquet").to_pydict()
    columns = ("t_sent_ns", "t_first_token_ns", "t_last_token_ns", "output_tokens")
    first = sorted(zip(*(requests[c] for c in columns), strict=True))[:3]
    row["tpot_first3_ms"] = statistics.median(
        (last - ft) / 1e6 / (n - 1) for _, ft, last, n in first if n and n > 1
    )
    return row


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_sampling_rss(cmd: list[str], env: dict) -> tuple[int, str, list[int]]:
    """Run `cmd`; return its exit status, stderr and the summed RSS of its descendants (not
    of itself, the bench client), sampled every 0.2 s."""
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as proc:
        samples = []
        while proc.poll() is None:
            pending, seen = _children(proc.pid), set()
            while pending:
                pid = pending.pop()
                if pid not in seen:
                    seen.add(pid)
                    pending += _children(pid)
            if seen:
                samples.append(sum(_rss_bytes(p) for p in seen))
            time.sleep(0.2)
        stderr = proc.stderr.read()
    return proc.returncode, stderr, samples or [0]


KEYS = (
    "tpot_p50_ms",
    "tpot_first3_ms",
    "itl_p50_ms",
    "output_tok_s",
    "server_rss_median_mb",
    "server_rss_max_mb",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="llamacpp,ref-w4a16,ref-w4a16-torch")
    parser.add_argument("--llamacpp-python", default=None, help="python of llama-cpp-python's venv")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="reference engine threads")
    parser.add_argument("--kv-cache-bytes", default="400MiB", help="reference engine KV pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/w4a16-vs-llamacpp"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    # A float32 engine does not wait for the engine kernels' first build; build them now.
    kernels.available()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config {unknown[0]!r}; use {', '.join(CONFIGS)}")
    if "llamacpp" in configs and not args.llamacpp_python:
        parser.error("the llamacpp config needs --llamacpp-python (its venv's python)")

    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for config in order:
            out = args.out / f"{config}-r{r + 1}"
            cmd, env = command(config, args, out)
            t0 = time.monotonic()
            returncode, stderr, rss = run_sampling_rss(cmd, env)
            if returncode != 0:
                print(f"{config} round {r + 1} failed (exit {returncode}):\n{stderr[-2000:]}")
                return 1
            row = figures(out) | {"round": r + 1, "wall_s": time.monotonic() - t0}
            row["server_rss_max_mb"] = max(rss) / 2**20  # the load's peak included
            row["server_rss_median_mb"] = statistics.median(rss) / 2**20  # mostly serving
            runs[config].append(row)
            if row["ok"] != row["requests"]:
                print(f"warning: {config} round {r + 1}: {row['ok']} of {row['requests']} ok")
            print(
                f"round {r + 1} {config:16s} TPOT p50 {row['tpot_p50_ms']:6.2f} ms "
                f"(first 3 requests {row['tpot_first3_ms']:6.2f})  "
                f"ITL p50 {row['itl_p50_ms']:6.2f} ms  {row['output_tok_s'] or 0:6.1f} tok/s  "
                f"RSS median {row['server_rss_median_mb']:5.0f} MB, peak {row['server_rss_max_mb']:5.0f}",
                flush=True,
            )

    anchor = "llamacpp" if "llamacpp" in configs else configs[0]
    medians = {
        c: {k: statistics.median(r[k] for r in rows if r.get(k) is not None) for k in KEYS}
        for c, rows in runs.items()
    }
    print(
        f"\nmedians of {args.rounds} rounds ({args.num_requests} requests of "
        f"{args.input_len} -> {args.output_len} tokens, concurrency 1):"
    )
    print(
        f"| config | TPOT p50 ms | vs {anchor} | TPOT, first 3 requests | ITL p50 ms "
        "| output tok/s | server RSS MB, median | peak |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for c, m in medians.items():
        ratio = m["tpot_p50_ms"] / medians[anchor]["tpot_p50_ms"]
        print(
            f"| {c} | {m['tpot_p50_ms']:.2f} | {ratio:.2f}x | {m['tpot_first3_ms']:.2f} | "
            f"{m['itl_p50_ms']:.2f} | {m['output_tok_s']:.1f} | {m['server_rss_median_mb']:.0f} | "
            f"{m['server_rss_max_mb']:.0f} |"
        )
    if args.json:
        config = vars(args) | {"out": str(args.out), "json": str(args.json)}
        args.json.write_text(json.dumps({"config": config, "runs": runs, "medians": medians}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
