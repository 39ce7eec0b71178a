"""The GEMM-only floor of a SmolLM2-135M step: torch's time for the model's exact weight matmul
shapes at M rows (every layer's q, k, v, o, gate, up and down, then the output head), with no
attention, norms or framework around them. A decode step of M rows, or a prefill of M tokens,
cannot take less on this machine in that dtype; benchmarks quote their figures against it.

    python benchmarks/gemm_floor.py --rows 1 64 8192 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# SmolLM2-135M: hidden, kv width (3 heads of 64), intermediate, vocab, layers.
HIDDEN, KV, INTERMEDIATE, VOCAB, LAYERS = 576, 192, 1536, 49152, 30
LAYER_SHAPES = ((HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
                (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))  # fmt: skip


def weight_bytes(dtype: torch.dtype) -> int:
    """Bytes of the weights one step streams (the tied head once)."""
    per_layer = sum(n * k for n, k in LAYER_SHAPES)
    return (LAYERS * per_layer + VOCAB * HIDDEN) * torch.finfo(dtype).bits // 8


def step_seconds(
    rows: int, dtype: torch.dtype = torch.bfloat16, repeats: int | None = None
) -> float:
    """Median seconds of one step's weight GEMMs at `rows` rows (the threads torch has)."""
    weights = [torch.randn(n, k, dtype=dtype) for n, k in LAYER_SHAPES]
    head = torch.randn(VOCAB, HIDDEN, dtype=dtype)
    x = torch.randn(rows, HIDDEN, dtype=dtype)
    h = torch.randn(rows, INTERMEDIATE, dtype=dtype)

    def step() -> None:
        for _ in range(LAYERS):
            for i, w in enumerate(weights):
                (h if i == 6 else x) @ w.T
        x @ head.T

    repeats = repeats or (3 if rows >= 4096 else 15)
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batch_floor_seconds(prompts: int, prompt_len: int, output_len: int,
                        dtype: torch.dtype = torch.bfloat16) -> float:  # fmt: skip
    """The least a batch of `prompts` x `prompt_len` -> `output_len` can take: one prefill of
    every prompt token, then `output_len - 1` decode steps of `prompts` rows (the prefill
    yields each request's first token)."""
    return step_seconds(prompts * prompt_len, dtype) + (output_len - 1) * step_seconds(
        prompts, dtype
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 8192])
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    for rows in args.rows:
        seconds = step_seconds(rows, dtype)
        flops = 2 * rows * weight_bytes(dtype) / (torch.finfo(dtype).bits // 8)
        print(f"M={rows}: {seconds * 1e3:.1f} ms/step, {flops / seconds / 1e12:.3f} TFLOP/s, "
              f"{weight_bytes(dtype) / seconds / 1e9:.1f} GB/s of weights")  # fmt: skip


if __name__ == "__main__":
    main()
