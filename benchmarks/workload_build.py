"""Time materialising a 100,000-request workload (target: < 30 s on the 2-core CPU machine).

    python benchmarks/workload_build.py [--tokenizer smollm2-135m] [--workload sharegpt] [-n 100000]

Prints the build time of `resolve_workload` (no cache) and, as the baseline measured in the same
run, the naive approach (decode a token window, re-encode, retry until the count is exact, one
prompt at a time) timed on a sample and scaled to the same number of requests.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine_ref.loading import load_tokenizer
from workloads import WorkloadOptions, resolve_workload
from workloads.prompts import PromptSynthesizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="smollm2-135m")
    parser.add_argument("--workload", default="sharegpt")
    parser.add_argument("-n", "--num-requests", type=int, default=100_000)
    parser.add_argument("--baseline-sample", type=int, default=1_000)
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    options = WorkloadOptions(num_requests=args.num_requests)
    t0 = time.perf_counter()
    workload = resolve_workload(
        args.workload, options=options, tokenizer=tokenizer, use_cache=False
    )
    build_s = time.perf_counter() - t0
    lengths = workload.table.column("input_tokens").to_numpy()
    check = workload.manifest["prompt_check"]
    print(
        f"workload {args.workload!r}, tokenizer {tokenizer.name}: {workload.num_requests} requests, "
        f"{int(lengths.sum()):,} prompt tokens (median {int(np.median(lengths))})"
    )
    print(
        f"build (lengths + arrivals + token-exact prompts + table + sha256): {build_s:.2f} s "
        f"(target < 30 s); prompt check: {check['mode']}, {check['checked']} re-encoded, "
        f"{check['repaired']} repaired"
    )

    synth = PromptSynthesizer(tokenizer)
    rng = np.random.default_rng(0)
    sample = lengths[: args.baseline_sample]
    t0 = time.perf_counter()
    for n in sample.tolist():
        synth.retokenised_prompt(int(n), rng, lead=True)
    naive_s = (time.perf_counter() - t0) * len(lengths) / len(sample)
    print(
        f"baseline (decode + re-encode each prompt, timed on {len(sample)}, scaled): {naive_s:.2f} s "
        f"-> {naive_s / build_s:.1f}x"
    )


if __name__ == "__main__":
    main()
