"""Which thread loads the engine and which one steps it: does it change throughput?

Three placements of the same in-process batch (no HTTP), each in a fresh process so OpenMP
starts clean:

- main:          the engine is built and stepped on the main thread (what a script does);
- other-thread:  built on the main thread, stepped on a second thread (what the server did
                 before the engine thread built its own engine);
- same-thread:   built and stepped on one second thread (what `ThreadEngineLoop(build=...)`
                 does now).

With torch's libgomp, every thread that starts a parallel region gets its own OpenMP team;
two teams on a 2-core machine mean more OpenMP threads than cores, and libgomp then parks its
workers after a few spins at every barrier. Placements alternate for `--rounds` rounds; each
run does one untimed warm-up batch, then a timed one.

    python benchmarks/engine_thread_placement.py                  # 64 x 128 x 64, 2 rounds
    python benchmarks/engine_thread_placement.py --output-len 16 --rounds 1   # quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

PLACEMENTS = ("main", "other-thread", "same-thread")


def child(placement: str, model: str, num: int, input_len: int, output_len: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    from engine_throughput import make_prompts, run_engine

    from engine_ref import EngineConfig, LLMEngine, build_engine

    prompts = make_prompts(np.random.default_rng(0), num, input_len, 49152)
    result: dict = {}

    def build() -> LLMEngine:
        return build_engine(EngineConfig(model=model))

    def measure(engine: LLMEngine) -> None:
        run_engine(engine, prompts, [output_len] * num)  # warm-up
        result.update(run_engine(engine, prompts, [output_len] * num))

    if placement == "main":
        measure(build())
    elif placement == "other-thread":
        engine = build()
        worker = threading.Thread(target=measure, args=(engine,))
        worker.start()
        worker.join()
    else:
        worker = threading.Thread(target=lambda: measure(build()))
        worker.start()
        worker.join()
    return {"output_tok_s": result["output_tokens"] / result["elapsed_s"], **result}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=PLACEMENTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.model, args.num_requests, args.input_len, args.output_len)
    if args.child:
        print(json.dumps(child(args.child, *shape)))
        return
    rates: dict[str, list[float]] = {p: [] for p in PLACEMENTS}
    for round_index in range(args.rounds):
        for placement in PLACEMENTS:
            cmd = [sys.executable, __file__, "--child", placement, "--model", args.model,
                   "--num-requests", str(args.num_requests), "--input-len", str(args.input_len),
                   "--output-len", str(args.output_len)]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rate = json.loads(out.strip().splitlines()[-1])["output_tok_s"]
            rates[placement].append(rate)
            print(f"round {round_index}  {placement:<13} {rate:7.1f} output tok/s", flush=True)
    print("median output tok/s: " + ", ".join(
        f"{p} {statistics.median(r):.1f}" for p, r in rates.items()))  # fmt: skip


if __name__ == "__main__":
    main()
