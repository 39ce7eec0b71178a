"""What lossy KV costs: perplexity and greedy agreement for each KV dtype and eviction policy,
beside memory per request and tokens/s, in one table, all through `LLMEngine.step`.

Every configuration is an engine built from the same loaded model (SmolLM2 by default); the
exact one (`exact`: KV in the engine's dtype, no eviction) is the baseline. Per configuration:

- perplexity: teacher-forced over the bundled text `benchmarks/data/quantization_eval.txt`: a
  request whose prompt is the text's first `--ppl-prompt` tokens decodes the next
  `--ppl-tokens`, one row a step, each step's logits scored against the text's next token and
  then forced to it (the benchmark wraps `ModelRunner.forward`; nothing else changes), so the
  KV written and read is the engine's own, evicted the engine's own way;
- greedy agreement with `exact`: `--prompts` prompts of `--prompt-len` tokens (cut from the
  text at different offsets, so they exceed an eviction window), `--max-tokens` outputs each,
  all admitted at once: the mean length of the identical prefix and the share of equal
  positions;
- memory: the KV pool's bytes for the same number of blocks (`--num-blocks`), and the mean
  per-request `kv_peak_bytes` and `kv_mean_bytes` (token-weighted) of the agreement run
  (`RequestOutput.kv_memory`; a prompt's prefill is not cut at an eviction window, so the
  peak of a windowed request is its prompt's, the mean what the window saves);
- speed: output tokens/s of the agreement run (wall clock, a median over `--repeats`).

    python benchmarks/kv_quality.py                        # every configuration
    python benchmarks/kv_quality.py --configs exact,int8 --repeats 1 --json out.json
    python benchmarks/kv_quality.py --model tiny-random --ppl-tokens 64 --prompts 4  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ref import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_ref.loading.model_files import DEFAULT_MODEL  # noqa: E402
from engine_ref.loading.weights import load_model  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "quantization_eval.txt"
WINDOW = {"kv_window_tokens": 128, "kv_sink_tokens": 4}
CONFIGS = {  # name -> EngineConfig overrides
    "exact": {},
    "bf16": {"kv_cache_dtype": "bf16"},
    "fp16": {"kv_cache_dtype": "fp16"},
    "int8": {"kv_cache_dtype": "int8"},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "sliding-window": {"kv_eviction": "sliding-window", **WINDOW},
    "sinks": {"kv_eviction": "sinks", **WINDOW},
    "int8+sinks": {"kv_cache_dtype": "int8", "kv_eviction": "sinks", **WINDOW},
}


def build(loaded, dtype: str, num_blocks: int, threads: int, overrides: dict) -> LLMEngine:
    config = EngineConfig(
        model="bench", dtype=dtype, device="cpu", num_blocks=num_blocks, num_threads=threads,
        enable_prefix_caching=False, **overrides,
    )  # fmt: skip
    return LLMEngine(config, loaded=loaded)


def perplexity(engine: LLMEngine, ids: list[int], prompt: int, tokens: int) -> float:
    """exp(mean NLL) of ids[prompt : prompt + tokens], teacher-forced (module doc)."""
    runner = engine.model_runner
    forward = runner.forward
    nll: list[float] = []

    def forced(items):
        out = forward(items)
        if out.logits is not None:
            for row, seq in enumerate(out.sampling_seqs):
                target = ids[len(seq.token_ids)]
                logp = torch.log_softmax(out.logits[row].float(), dim=-1)
                nll.append(-float(logp[target]))
                out.logits[row] = float("-inf")
                out.logits[row, target] = 0.0
        return out

    runner.forward = forced
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        engine.add_request("ppl", ids[:prompt], params)
        while engine.has_unfinished():
            engine.step()
    finally:
        runner.forward = forward
    return math.exp(statistics.fmean(nll))


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    peaks, means, evicted = [], [], 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
            if out.finished:
                peaks.append(out.kv_memory["kv_peak_bytes"])
                means.append(out.kv_memory["kv_mean_bytes"])
                evicted += out.kv_evicted_tokens > 0
    elapsed = time.perf_counter() - start
    return {
        "tokens": [tokens[f"g{i}"] for i in range(len(prompts))],
        "tokens_per_s": len(prompts) * max_tokens / elapsed,
        "kv_peak_bytes_mean": statistics.fmean(peaks),
        "kv_mean_bytes_mean": statistics.fmean(means),
        "requests_evicted": evicted,
    }


def agreement(outputs: list[list[int]], baseline: list[list[int]]) -> tuple[float, float]:
    prefix, equal, total = [], 0, 0
    for a, b in zip(outputs, baseline, strict=True):
        same = [x == y for x, y in zip(a, b, strict=True)]
        prefix.append(same.index(False) if False in same else len(same))
        equal += sum(same)
        total += len(same)
    return statistics.fmean(prefix), equal / total


def pool_bytes(engine: LLMEngine) -> int:
    stats = engine.stats()
    return stats.kv_bytes_per_token * stats.block_size * stats.num_blocks_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16", help="the activations' (and exact KV's)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ppl-prompt", type=int, default=16)
    parser.add_argument("--ppl-tokens", type=int, default=384)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    if "exact" not in names:
        names.insert(0, "exact")
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype)
    ids = list(loaded.tokenizer.encode(TEXT.read_text()))
    needed = args.ppl_prompt + args.ppl_tokens + 1
    if len(ids) < max(needed, args.prompt_len + 8 * (args.prompts - 1)):
        parser.error(f"the text has {len(ids)} tokens: lower --ppl-tokens or --prompt-len")
    prompts = [ids[8 * i : 8 * i + args.prompt_len] for i in range(args.prompts)]
    engines = {
        n: build(loaded, args.dtype, args.num_blocks, args.threads, CONFIGS[n]) for n in names
    }
    rows = {n: {"config": n, **CONFIGS[n]} for n in names}
    speeds: dict[str, list[float]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]  # rotated
        for n in order:
            run = generate(engines[n], prompts, args.max_tokens)
            speeds[n].append(run["tokens_per_s"])
            rows[n].update(run)
    exact_tokens = rows["exact"]["tokens"]
    for n in names:
        row = rows[n]
        row["tokens_per_s"] = statistics.median(speeds[n])
        row["prefix_mean"], row["agreement"] = agreement(row["tokens"], exact_tokens)
        row["perplexity"] = perplexity(engines[n], ids, args.ppl_prompt, args.ppl_tokens)
        row["pool_bytes"] = pool_bytes(engines[n])
        del row["tokens"]
    base = rows["exact"]
    print(f"# {args.model}, {args.dtype} activations, {platform.processor() or platform.machine()}, "
          f"{args.threads} threads; {args.num_blocks} blocks; {args.prompts} prompts x "
          f"{args.prompt_len} tokens -> {args.max_tokens}; perplexity over {args.ppl_tokens} tokens")  # fmt: skip
    header = ("config", "perplexity", "ppl/exact", "prefix", "agree", "pool MiB", "pool/exact",
              "KV peak/req KiB",
        "KV mean/req KiB", "evicted reqs", "tok/s", "tok/s/exact")  # fmt: skip
    print(" | ".join(header))
    for n in names:
        r = rows[n]
        print(" | ".join([
            n, f"{r['perplexity']:.3f}", f"{r['perplexity'] / base['perplexity']:.4f}",
            f"{r['prefix_mean']:.1f}", f"{r['agreement']:.3f}", f"{r['pool_bytes'] / 2**20:.1f}",
            f"{r['pool_bytes'] / base['pool_bytes']:.3f}", f"{r['kv_peak_bytes_mean'] / 1024:.0f}",
                    f"{r['kv_mean_bytes_mean'] / 1024:.0f}",
            str(r["requests_evicted"]), f"{r['tokens_per_s']:.1f}",
            f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}",
        ]))  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
