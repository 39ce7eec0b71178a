"""What memory-per-request accounting (`engine_ref.core.kv_accounting`) costs a decode step:
the same engine and requests with `KVAccounting.observe` on and replaced by a no-op, alternated,
medians of each run's last 20 steps, then the median over runs.

    python benchmarks/kv_accounting_cost.py                      # tiny-random, 64 x 512 tokens
    python benchmarks/kv_accounting_cost.py --model smollm2-135m --requests 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ref import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_ref.core import kv_accounting  # noqa: E402
from engine_ref.loading.weights import load_model  # noqa: E402


def step_time(loaded, model: str, requests: int, prompt_len: int, accounting: bool) -> float:
    observe = kv_accounting.KVAccounting.observe
    if not accounting:
        kv_accounting.KVAccounting.observe = lambda *args, **kwargs: None
    try:
        config = EngineConfig(model=model, dtype="bfloat16", device="cpu", num_threads=2,
                              num_blocks=4096)  # fmt: skip
        engine = LLMEngine(config, loaded=loaded)
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        for i in range(requests):
            engine.add_request(str(i), [(7 * i + j) % 400 + 5 for j in range(prompt_len)], params)
        times = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times[-20:])
    finally:
        kv_accounting.KVAccounting.observe = observe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype="bfloat16")
    runs: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for accounting in (True, False):
            runs[accounting].append(
                step_time(loaded, args.model, args.requests, args.prompt_len, accounting)
            )
    on, off = statistics.median(runs[True]), statistics.median(runs[False])
    print(f"{args.model}, {args.requests} requests x {args.prompt_len} prompt tokens: decode step "
          f"{on * 1e3:.2f} ms with accounting, {off * 1e3:.2f} ms without, ratio {on / off:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
