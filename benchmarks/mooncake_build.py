"""Build a synthetic Mooncake-format trace workload: the streaming builder against the previous
in-memory one, side by side, then the trace-scale build alone (time, peak RSS, block reuse).

    python benchmarks/mooncake_build.py [--requests 12000] [--prompt-tokens 8000]
        [--compare-requests 2000] [--baseline-rev b15e5ad] [--tokenizer smollm2-135m]

The trace: conversations whose turns extend their previous turn's hash ids (so later turns
share a growing prefix), each opening with one of 64 shared system blocks; every request has
`--prompt-tokens` prompt tokens (16 hash ids of 512 tokens for 8,000). Each build runs in a
fresh process (`bench workload build`'s library path) that reports its wall time and peak RSS
(`ru_maxrss`). The baseline is this repository's `workloads/` at `--baseline-rev` (the commit
before streaming builds), exported with `git archive`; it builds in memory and then writes the
file, as `bench workload build` did. After the new build, the infinite-cache block reuse is
computed from the file's token ids (streamed by row group) and from the trace's hash ids; the
two must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 512

CHILD = r"""
import json, resource, sys, time
import workloads
assert sys.argv[5] == workloads.__file__.rsplit("/workloads/", 1)[0], workloads.__file__
from pathlib import Path
mode, trace, out, tokenizer_name = sys.argv[1:5]
from engine_ref.loading import load_tokenizer
from workloads.registry import find_spec
from workloads.options import WorkloadOptions
tok = load_tokenizer(tokenizer_name)
spec_path = Path(out).with_suffix(".yaml")
spec_path.write_text(
    "name: mooncake-bench\nnum_requests: null\n"
    f"source: {{kind: trace, format: mooncake, path: {trace}}}\narrivals: {{process: trace}}\n"
)
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
spec = find_spec(str(spec_path))
if mode == "baseline":
    from workloads.build import build_workload
    from workloads.store import write_parquet
    built = build_workload(spec, WorkloadOptions(), tok)
    write_parquet(built, Path(out))
    manifest = built.manifest
else:
    from workloads.build import build_workload_file
    manifest = build_workload_file(spec, WorkloadOptions(), tok, Path(out))
seconds = time.perf_counter() - t0
print(json.dumps({
    "seconds": seconds,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "rss_before_build_mb": rss0 / 1024,
    "requests": manifest["num_requests"],
    "prompt_check": manifest["prompt_check"],
}))
"""


def synthetic_trace(path: Path, n: int, prompt_tokens: int, seed: int = 0) -> None:
    """Write `n` Mooncake rows: conversations of 1-8 turns, turn t+1 keeping turn t's first
    blocks and adding new ones, every prompt exactly `prompt_tokens` tokens."""
    rng = np.random.default_rng(seed)
    blocks = -(-prompt_tokens // BLOCK)
    next_id = 64  # ids 0..63: shared system blocks
    rows, t_ms = [], 0
    while len(rows) < n:
        ids = [int(rng.integers(0, 64))]
        for _ in range(int(rng.integers(1, 9))):
            keep = int(rng.integers(len(ids) // 2, len(ids) + 1)) if len(ids) > 1 else 1
            ids = ids[:keep]
            while len(ids) < blocks:
                ids.append(next_id)
                next_id += 1
            t_ms += int(rng.integers(1, 200))
            rows.append(
                {
                    "timestamp": t_ms,
                    "input_length": prompt_tokens,
                    "output_length": int(rng.integers(16, 512)),
                    "hash_ids": list(ids),
                }
            )
            if len(rows) == n:
                break
            ids = ids[: int(rng.integers(1, blocks))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build(mode: str, trace: Path, out: Path, tokenizer: str, pythonpath: str) -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    done = subprocess.run(  # cwd: out's folder, so `-c` does not put this tree first on sys.path
        [
            *("nice", "-n", "19", sys.executable, "-c", CHILD),
            *(mode, str(trace), str(out), tokenizer, pythonpath.split(os.pathsep)[0]),
        ],
        env=env,
        cwd=out.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode} build failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def reuse_equality(trace: Path, built: Path) -> tuple[int, int]:
    """(block hits from the file's token ids, block hits from the trace's hash ids)."""
    import pyarrow.parquet as pq

    from workloads.blocks import block_reuse_from_ids, block_reuse_from_tokens

    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    from_ids = block_reuse_from_ids(
        [r["hash_ids"] for r in rows], [r["input_length"] for r in rows]
    )

    def token_rows():
        for batch in pq.ParquetFile(built).iter_batches(columns=["prompt_token_ids"]):
            column = batch.column(0)
            offsets = column.offsets.to_numpy()
            values = column.values.to_numpy()
            for i in range(len(column)):
                yield values[offsets[i] : offsets[i + 1]]

    return block_reuse_from_tokens(token_rows()), from_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12_000)
    parser.add_argument("--prompt-tokens", type=int, default=8_000)
    parser.add_argument("--compare-requests", type=int, default=2_000)
    parser.add_argument("--baseline-rev", default="b15e5ad")
    parser.add_argument("--tokenizer", default="smollm2-135m")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mooncake-bench-") as tmp_name:
        tmp = Path(tmp_name)
        old_tree = tmp / "baseline"
        old_tree.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline_rev, "workloads"],
            capture_output=True,
            check=True,
        ).stdout
        (tmp / "old.tar").write_bytes(archive)
        with tarfile.open(tmp / "old.tar") as tar:
            tar.extractall(old_tree, filter="data")
        new_path = str(ROOT)
        old_path = f"{old_tree}{os.pathsep}{ROOT}"  # the old workloads/ shadows ours

        small = tmp / "small.jsonl"
        synthetic_trace(small, args.compare_requests, args.prompt_tokens)
        print(
            f"side by side: {args.compare_requests} requests x {args.prompt_tokens} prompt tokens, "
            f"tokenizer {args.tokenizer}"
        )
        results = {}
        for mode, path in (("baseline", old_path), ("streaming", new_path)):
            results[mode] = r = build(mode, small, tmp / f"{mode}.parquet", args.tokenizer, path)
            print(
                f"  {mode:<9} ({'workloads/ at ' + args.baseline_rev if mode == 'baseline' else 'this tree'}): "
                f"{r['seconds']:7.2f} s, peak RSS {r['peak_rss_mb']:7.0f} MB"
            )
        old, new = results["baseline"], results["streaming"]
        print(
            f"  -> {old['seconds'] / new['seconds']:.1f}x faster, "
            f"{old['peak_rss_mb'] / new['peak_rss_mb']:.1f}x less peak RSS"
        )
        hits_tokens, hits_ids = reuse_equality(small, tmp / "streaming.parquet")
        print(f"  block reuse: {hits_tokens} from token ids, {hits_ids} from hash ids")
        (tmp / "baseline.parquet").unlink()
        (tmp / "streaming.parquet").unlink()

        big = tmp / "big.jsonl"
        synthetic_trace(big, args.requests, args.prompt_tokens)
        r = build("streaming", big, tmp / "big.parquet", args.tokenizer, new_path)
        hits_tokens, hits_ids = reuse_equality(big, tmp / "big.parquet")
        print(
            f"trace scale: {r['requests']} requests x {args.prompt_tokens} prompt tokens "
            f"({r['requests'] * args.prompt_tokens / 1e6:.0f} M): {r['seconds']:.1f} s, "
            f"peak RSS {r['peak_rss_mb']:.0f} MB (target < 2048 MB; {r['rss_before_build_mb']:.0f} MB "
            f"before the build started), file {(tmp / 'big.parquet').stat().st_size / 1e6:.0f} MB; "
            f"prompt check {r['prompt_check']}"
        )
        print(
            f"  block reuse: {hits_tokens} from token ids, {hits_ids} from hash ids -> "
            f"{'equal' if hits_tokens == hits_ids else 'DIFFERENT'}"
        )
        if hits_tokens != hits_ids:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
