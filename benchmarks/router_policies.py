"""Prefix-affinity against round-robin routing over `bench serve --replicas 2` (issue 27's
acceptance): prefix-cache hit rate and TTFT on shared-prefix workloads and multi-turn chat, the
two policies alternated per workload, each run against a freshly started cluster.

    python benchmarks/router_policies.py [--model smollm2-135m] [--repeats 1]

Workloads: the built-in `shared-prefix` (4 groups assigned round robin: over 2 workers,
round-robin routing keeps each group on one worker by accident), `benchmarks/data/shared-
prefix-random.yaml` (8 groups at random) and the built-in `multi-turn` with `--sessions`
sessions. The hit rate is the router's merged `vllm:prefix_cache_hits_total` over
`..._queries_total` (prompt tokens) across the run, as `bench run`'s summary reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_vs_colocated import cpu_name, start_server, stop  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("round-robin", "prefix-affinity")


def workloads(args) -> dict[str, list[str]]:
    return {
        "shared-prefix": ["--workload", "shared-prefix"],
        "shared-prefix, 8 groups at random": [
            "--workload", str(REPO / "benchmarks" / "data" / "shared-prefix-random.yaml"),
        ],
        f"multi-turn, {args.sessions} sessions": [
            "--workload", "multi-turn", "--num-requests", str(args.sessions),
        ],
    }  # fmt: skip


def one_run(url: str, model: str, workload: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "harness.cli", "run", "--url", f"{url}/v1", "--model", model,
           *workload, "--seed", "0", "--out", str(out), "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    summary = json.loads((out / "summary.json").read_text())
    ttft = summary["latency_ms"]["ttft"]
    return {
        "hit_rate": summary["server_metrics"]["prefix_cache_hit_rate"],
        "ttft_p50": ttft["p50"],
        "ttft_p99": ttft["p99"],
        "requests": summary["counts"]["total"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=12)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; model {args.model}; --replicas 2")
    logs = Path(tempfile.mkdtemp(prefix="router-bench-logs-"))
    rows = []
    for name, workload in workloads(args).items():
        results: dict[str, list[dict]] = {p: [] for p in POLICIES}
        for r in range(args.repeats):
            for policy in POLICIES if r % 2 == 0 else reversed(POLICIES):
                server = ["--model", args.model, "--replicas", "2", "--router", policy]
                proc, url = start_server(server, logs / f"{len(rows)}-{policy}-{r}.log")
                out = Path(tempfile.mkdtemp(prefix="router-bench-run-")) / "run"
                try:
                    results[policy].append(one_run(url, args.model, workload, out))
                finally:
                    stop(proc)
                    shutil.rmtree(out.parent, ignore_errors=True)
        med = {p: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
               for p, runs in results.items()}  # fmt: skip
        rows.append((name, med))
        print(f"{name}: " + "; ".join(
            f"{p} hit rate {m['hit_rate']:.3f}, TTFT p50 {m['ttft_p50']:.0f} ms, p99 "
            f"{m['ttft_p99']:.0f} ms ({m['requests']:.0f} requests)" for p, m in med.items()
        ), flush=True)  # fmt: skip
    print(f"\n| workload | {' | '.join(f'{p} hit rate' for p in POLICIES)} | TTFT p50 / p99 ms "
          f"({' -> '.join(POLICIES)}) |")  # fmt: skip
    print("|---|---|---|---|")
    for name, med in rows:
        rr, pa = (med[p] for p in POLICIES)
        print(f"| {name} | {rr['hit_rate']:.3f} | {pa['hit_rate']:.3f} | "
              f"{rr['ttft_p50']:.0f} / {rr['ttft_p99']:.0f} -> "
              f"{pa['ttft_p50']:.0f} / {pa['ttft_p99']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
