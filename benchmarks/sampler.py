"""One sampled decode step's draw, side by side: the engine's inverse-CDF sampler against the
exponential race it replaced, on logits of SmolLM2's vocabulary.

Both draw one token per row from the same filtered probabilities [R, V]: the race as
argmax(p / E) with E ~ Exp(1) drawn for every vocabulary entry (torch's `exponential_`), the
engine's `sampler.inverse_cdf` with one uniform a row. The two alternate `--repeats` times in
one process; the medians and their ratio are printed, with the CPU and the thread count.

    python benchmarks/sampler.py                  # 64 rows x 49,152, 2 threads
    python benchmarks/sampler.py --rows 1,16,64 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ref.core.sampler import inverse_cdf  # noqa: E402
from harness.run.environment import hardware_info  # noqa: E402


def race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def cdf(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    uniforms = torch.rand(probs.shape[0], generator=generator, dtype=torch.float64)
    return inverse_cdf(probs, uniforms)


def timed_ms(fn, probs: torch.Tensor, generator: torch.Generator, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(probs, generator)
    return (time.perf_counter() - t0) * 1e3 / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="64", help="comma-separated")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="draws per timing")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    print(f"CPU: {hardware_info()['cpu']}, {args.threads} threads, vocabulary {args.vocab}")
    print(f"{'rows':>5} {'race ms':>9} {'inverse CDF ms':>15} {'race / CDF':>11}")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, generator=generator) * 3
        probs = logits.softmax(dim=-1)
        times: dict[str, list[float]] = {"race": [], "cdf": []}
        for fn in (race, cdf):  # warm-up
            fn(probs, generator)
        for _ in range(args.repeats):
            times["race"].append(timed_ms(race, probs, generator, args.calls))
            times["cdf"].append(timed_ms(cdf, probs, generator, args.calls))
        a, b = statistics.median(times["race"]), statistics.median(times["cdf"])
        print(f"{rows:>5} {a:9.2f} {b:15.2f} {a / b:10.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
