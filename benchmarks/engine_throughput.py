"""In-process throughput of the reference engine against Hugging Face `generate`, same run.

Scenario "equal": N requests x P random prompt tokens x O output tokens (ignore_eos), all
admitted at once; HF runs the same batch statically (min_new_tokens = max_new_tokens = O).
Scenario "lognormal": same prompts, output lengths lognormal (median O, sigma 0.8, capped,
seeded); HF must generate the longest length for every row, and only the requested tokens
count as its useful output.

    python benchmarks/engine_throughput.py                      # 64 x 128 x 128, both scenarios
    python benchmarks/engine_throughput.py --num-requests 8 --output-len 32   # quick
    python benchmarks/engine_throughput.py --json out.json --skip-hf

Prints a table; `--json PATH` writes the figures. Ratios compare the engine with HF measured in
the same process, which is what matters on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ref import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_ref.core import kernels  # noqa: E402


def make_prompts(rng: np.random.Generator, num: int, length: int, vocab: int) -> list[list[int]]:
    # Avoid the lowest ids (special tokens in SmolLM2's vocabulary).
    return rng.integers(100, vocab, size=(num, length)).tolist()


def lognormal_lengths(rng: np.random.Generator, num: int, median: int, cap: int) -> list[int]:
    draws = rng.lognormal(mean=math.log(median), sigma=0.8, size=num)
    return [int(min(cap, max(1, round(x)))) for x in draws]


def run_engine(engine: LLMEngine, prompts: list[list[int]], lengths: list[int]) -> dict:
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    steps = 0
    output_tokens = 0
    t_first = None
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                output_tokens += len(c.new_token_ids)
        steps += 1
        if t_first is None and output_tokens:
            t_first = time.perf_counter()
    elapsed = time.perf_counter() - t0
    return {
        "elapsed_s": elapsed,
        "steps": steps,
        "output_tokens": output_tokens,
        "useful_output_tokens": output_tokens,
        "prefill_s": (t_first or t0) - t0,
    }


def build_hf_model(loaded, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine_ref.loading.export import hf_config_dict

    config = LlamaConfig(**hf_config_dict(loaded, dtype))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {k: v.to(dtype) for k, v in loaded.state_dict.items()}
    if loaded.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # rebuild off meta
    return model.eval()


def run_hf(model, prompts: list[list[int]], lengths: list[int]) -> dict:
    ids = torch.tensor(prompts)
    new = max(lengths)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            min_new_tokens=new,
            max_new_tokens=new,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - t0
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "useful_output_tokens": sum(lengths),
    }


def rates(result: dict, num_prompt_tokens: int) -> dict:
    t = result["elapsed_s"]
    useful = result["useful_output_tokens"]
    return {
        **result,
        "output_tok_s": useful / t,
        "total_tok_s": (useful + num_prompt_tokens) / t,
    }


def print_row(name: str, row: dict) -> None:
    for system in ("engine", "hf"):
        if system in row:
            r = row[system]
            print(
                f"{name:<10} {system:<7} {r['elapsed_s']:>8.2f} {r['output_tok_s']:>10.1f}"
                f" {r['total_tok_s']:>12.1f}",
                flush=True,
            )
    if "ratio_output" in row:
        print(f"{name:<10} ratio engine/hf (useful output tok/s): {row['ratio_output']:.2f}x")


def profile_decode(engine: LLMEngine, prompts: list[list[int]], steps: int = 5) -> str:
    """torch.profiler table of `steps` decode steps with every prompt running."""
    from torch.profiler import ProfilerActivity, profile

    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        engine.add_request(f"p{i}", prompt, params)
    total_prompt_tokens = sum(len(p) for p in prompts)
    while engine.stats().prompt_tokens_total < total_prompt_tokens:  # prefill everything
        engine.step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    per_step_ms = (time.perf_counter() - t0) / steps * 1000
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return f"decode step with {len(prompts)} running: {per_step_ms:.1f} ms (profiled)\n{table}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--lognormal-cap", type=int, default=512)
    parser.add_argument("--scenarios", default="equal,lognormal")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile", action="store_true", help="print torch.profiler's top ops for decode steps"
    )
    args = parser.parse_args(argv)
    # A float32 engine does not wait for the engine kernels' first build; build them now.
    kernels.available()

    torch.set_num_threads(args.threads)
    from engine_ref.loading.weights import load_model

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    loaded = load_model(args.model, dtype=dtype)
    rng = np.random.default_rng(args.seed)
    prompts = make_prompts(rng, args.num_requests, args.input_len, loaded.config.vocab_size)
    scenarios = {
        "equal": [args.output_len] * args.num_requests,
        "lognormal": lognormal_lengths(rng, args.num_requests, args.output_len, args.lognormal_cap),
    }
    overrides = {}
    if args.max_num_batched_tokens:
        overrides["max_num_batched_tokens"] = args.max_num_batched_tokens
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device="cpu",
        num_threads=args.threads,
        max_model_len=args.input_len + max(max(v) for v in scenarios.values()) + 1,
        **overrides,
    )
    hf_model = None if args.skip_hf else build_hf_model(loaded, dtype)
    num_prompt_tokens = args.num_requests * args.input_len
    warmup_prompts = make_prompts(rng, 2, args.input_len, loaded.config.vocab_size)
    if hf_model is not None:  # so first-call costs are not timed
        run_hf(hf_model, warmup_prompts, [4, 4])

    report: dict = {"config": vars(args) | {"json": str(args.json)}, "scenarios": {}}
    print(f"{'scenario':<10} {'system':<7} {'time s':>8} {'out tok/s':>10} {'total tok/s':>12}")
    for name in args.scenarios.split(","):
        lengths = scenarios[name]
        row = {"output_lengths_sum": sum(lengths), "output_lengths_max": max(lengths)}
        # A fresh engine per scenario: no prefix-cache hits from an earlier run of the prompts.
        engine = LLMEngine(config, loaded=loaded)
        run_engine(engine, warmup_prompts, [4, 4])
        row["engine"] = rates(run_engine(engine, prompts, lengths), num_prompt_tokens)
        row["engine_stats"] = vars(engine.stats())
        if hf_model is not None:
            row["hf"] = rates(run_hf(hf_model, prompts, lengths), num_prompt_tokens)
            row["ratio_output"] = row["engine"]["output_tok_s"] / row["hf"]["output_tok_s"]
        report["scenarios"][name] = row
        print_row(name, row)
    if args.profile:
        print(profile_decode(LLMEngine(config, loaded=loaded), prompts))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
