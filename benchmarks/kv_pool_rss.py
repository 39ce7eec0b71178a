"""The KV pool's bytes for each KV dtype, side by side, as a user sees them: the reference
server's resident memory (VmRSS of its process, /proc/<pid>/status) and its own gauge
`vllm:kv_cache_pool_bytes`, with the same number of blocks (`--num-blocks`) for every dtype.

Each round starts one server per KV dtype in turn (the order rotated per round), waits for
`/health`, sends one short greedy request (so the pool and the decode path have run), then reads
RSS and `/metrics`; medians over the rounds. The RSS difference from the first dtype isolates the
pool (the weights and the runtime are the same in every server); the gauge is the pool's bytes,
scales included. Ratios against the first dtype named.

    python benchmarks/kv_pool_rss.py                                   # SmolLM2, 4,096 blocks
    python benchmarks/kv_pool_rss.py --model tiny-random --num-blocks 2048 --rounds 1
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import urllib.request
from pathlib import Path

import click

from harness.targets.managed import ManagedServerConfig, managed_server

GAUGE = re.compile(r"^vllm:kv_cache_pool_bytes\{[^}]*\} (\S+)$", re.MULTILINE)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no VmRSS for process {pid}")


def measure(model: str, kv_dtype: str, num_blocks: int, threads: int) -> dict:
    args = ("--kv-cache-dtype", kv_dtype, "--num-blocks", str(num_blocks),
            "--num-threads", str(threads), "--log-level", "warning")  # fmt: skip
    config = ManagedServerConfig(model=model, startup_timeout_s=600, extra_args=args)
    with managed_server(config) as server:
        body = json.dumps({"model": model, "prompt": "The KV cache holds", "max_tokens": 8,
                           "temperature": 0}).encode()  # fmt: skip
        request = urllib.request.Request(
            server.base_url + "/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            resp.read()
        root = server.base_url.removesuffix("/v1")
        with urllib.request.urlopen(root + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        found = GAUGE.search(text)
        return {"rss": rss_bytes(server.pid), "gauge": float(found.group(1)) if found else None}


@click.command()
@click.option("--model", default="smollm2-135m")
@click.option("--dtypes", default="bf16,int8,fp8_e4m3,fp16", show_default=True)
@click.option("--num-blocks", type=int, default=4096, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option("--rounds", type=int, default=2, show_default=True)
@click.option("--json", "json_out", type=click.Path(path_type=Path))
def main(model, dtypes, num_blocks, threads, rounds, json_out):
    names = [d for d in dtypes.split(",") if d]
    samples: dict[str, list[dict]] = {d: [] for d in names}
    for r in range(rounds):
        for d in names[r % len(names) :] + names[: r % len(names)]:
            samples[d].append(measure(model, d, num_blocks, threads))
    rows = {}
    for d in names:
        rows[d] = {
            "rss": statistics.median(s["rss"] for s in samples[d]),
            "gauge": statistics.median(s["gauge"] or 0 for s in samples[d]),
        }
    base = rows[names[0]]
    print(f"# {model}, {num_blocks} blocks, {platform.processor() or platform.machine()}, "
          f"median of {rounds} round(s); MiB")  # fmt: skip
    print("kv dtype | RSS | RSS - first | pool gauge | gauge / first")
    for d in names:
        row = rows[d]
        print(
            f"{d} | {row['rss'] / 2**20:.1f} | {(row['rss'] - base['rss']) / 2**20:+.1f} | "
            f"{row['gauge'] / 2**20:.1f} | {row['gauge'] / base['gauge']:.4f}"
        )
    if json_out:
        json_out.write_text(json.dumps({"rows": rows, "samples": samples}, indent=2))


if __name__ == "__main__":
    main()
