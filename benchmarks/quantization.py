"""Quantized execution against the float baseline, side by side in one process.

Modes: `float32` (the baseline: what dtype=auto runs on an AVX2 CPU), `bf16` (optional),
`w4a16`, `w4a8`, `w8a16`, `w8a8`, `w4a16-torch` / `float32-torch` (W4A16 or float32 on torch's
kernels and the Python layers alone: the engine before its own kernels, for the before /
after split), and `w4a16-layers` (W4A16 on the engine's kernels but one Python module per
layer, without the fused decode layer: how w4a8 runs, so the two differ only in their GEMMs).
Every engine is built once from the same loaded file; each repeat runs every mode once, in an
order rotated per repeat, and the medians are reported.

- single stream: one request (32 prompt tokens, `--decode-tokens` output), decode tokens/s
  from the first to the last token, and TPOT p50 over the decode steps;
- batch: `--batch` requests of `--batch-input-len` prompt tokens and `--batch-output-len`
  output tokens, all admitted at once: output tokens/s over the whole run;
- weight-bytes bound: a single-stream decode step reads every projection and the output
  projection once, so its speed-up over the baseline is bounded by the ratio of those bytes;
  the table prints the measured ratio beside that bound;
- quality: greedy agreement with the baseline over the first 64 tokens of 32 prompts (the
  mean length of the identical prefix, and the fraction of equal positions), and perplexity
  of the bundled text `benchmarks/data/quantization_eval.txt`; prompts are decoded
  `--quality-batch` (8) at a time and the text fed 8 tokens per forward, so quality is
  measured on the kernels a decode step runs (up to 16 rows: the engine's own for w4a16);
- `--profile`: the single-stream step's split between the weight GEMMs and everything else,
  from torch.profiler (which inflates the "other" part a little), and the weight-GEMM kernels
  a step ran with their calls per step.

    python benchmarks/quantization.py                         # all modes, 3 repeats
    python benchmarks/quantization.py --modes float32,w4a16 --repeats 2 --skip-quality
    python benchmarks/quantization.py --modes float32,bf16,w4a16,w8a16,w8a8 --json out.json
    python benchmarks/quantization.py --modes float32,w4a16-torch,w4a16 --threads 2 --profile
    python benchmarks/quantization.py --modes float32,w4a16,w4a16-layers,w4a8,w8a8 --profile
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ref import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_ref.core import kernels  # noqa: E402
from engine_ref.core.attention import build_attention_metadata, kv_pool_shape  # noqa: E402
from engine_ref.core.quant import INT4_MODES  # noqa: E402
from engine_ref.loading.weights import load_model  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "quantization_eval.txt"
BASELINE = "float32"
MODES = {  # name -> (dtype, quantization)
    "float32": ("float32", None),
    "bf16": ("bfloat16", None),
    "w4a16": ("float32", "w4a16"),
    # The same int4 weights through torch's kernel and the Python layers: the engine before
    # its own kernels (engine_ref/core/kernels), side by side with them.
    "w4a16-torch": ("float32", "w4a16"),
    "float32-torch": ("float32", None),
    "w4a16-layers": ("float32", "w4a16"),
    "w4a8": ("float32", "w4a8"),
    "w8a16": ("float32", "w8a16"),
    "w8a8": ("float32", "w8a8"),
}
# Profiler names of the kernels that multiply by a weight matrix.
WEIGHT_GEMMS = {
    "aten::mm",
    "aten::addmm",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::_weight_int8pack_mm",
    "quantized::linear_dynamic",
    "refkern::q4_gemm",
    "refkern::q8_gemm",
    "refkern::f32_gemm",
    "refkern::q4_i8_gemm",
    "refkern::q8_i8_gemm",
}


def engine_kernels_off(engine: LLMEngine) -> None:
    """Run `engine` on torch's kernels and the Python layers only."""
    for module in engine.model.modules():
        if hasattr(module, "small"):
            module.small = False
    engine.model.fused_decode = None
    engine.model.small_head = False


# What a single-row call reads of a low-bit layer that holds two copies of its weights: the
# engine kernels' copy when they run (`small`), else torch's.
SMALL_PATH_BUFFERS = {"small_packed", "small_scale", "small_min", "weight_int8"}


def streamed_bytes(engine: LLMEngine) -> int:
    """Weight bytes one decode step reads: projections, norms and the output projection
    (a tied one is the embedding's storage; the embedding itself reads one row a token)."""
    kinds = engine.stats().weight_bytes_by_kind
    total = kinds["norm"]
    model = engine.model
    projections = [m for name, m in model.named_modules() if name.endswith("_proj")]
    for module in [*projections, model.lm_head]:
        named = dict(module.named_parameters(recurse=False)) | dict(
            module.named_buffers(recurse=False)
        )
        if getattr(module, "small", False):
            named = {k: t for k, t in named.items() if k in SMALL_PATH_BUFFERS}
        elif hasattr(module, "small"):
            named = {k: t for k, t in named.items() if not k.startswith("small_")}
        total += sum(t.untyped_storage().nbytes() for t in named.values())
        total += getattr(module, "packed_nbytes", 0)  # fbgemm's own copy
    return total


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy outputs and per-step times for `prompts`, all admitted at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    token_times: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            new = out.outputs[0].new_token_ids if out.outputs else []
            tokens[out.request_id] += new
            if new:
                token_times.append(now)
    elapsed = time.perf_counter() - t0
    return {
        "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
        "elapsed_s": elapsed,
        "token_times": token_times,
    }


def single_stream(engine: LLMEngine, prompt: list[int], max_tokens: int) -> dict:
    run = generate(engine, [prompt], max_tokens)
    times = run["token_times"]
    gaps = np.diff(times)
    return {
        "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
        "tpot_p50_ms": float(np.median(gaps)) * 1000,
    }


def batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    run = generate(engine, prompts, max_tokens)
    return {"output_tok_s": sum(len(t) for t in run["tokens"]) / run["elapsed_s"]}


def perplexity(engine: LLMEngine, ids: list[int], chunk: int) -> float:
    """exp(mean NLL) of `ids[1:]` given their prefixes, fed `chunk` tokens per forward (as a
    chunked prefill) into a scratch KV pool (the engine's own pools and prefix cache are left
    untouched). Chunks of at most 16 tokens run the kernels a decode step runs (the engine's
    own where they build); one chunk of the whole text runs the large-batch ones."""
    mc, bs = engine.model_config, engine.config.block_size
    num_blocks = -(-len(ids) // bs)
    shape = kv_pool_shape(num_blocks + 1, bs, mc.num_key_value_heads, mc.head_dim)
    pools = [torch.zeros(shape, dtype=engine.dtype) for _ in range(mc.num_hidden_layers)]
    logits = []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start : min(start + chunk, len(ids) - 1)]
            meta = build_attention_metadata(
                start_positions=[start],
                num_new_tokens=[len(piece)],
                block_tables=[list(range(num_blocks))],
                block_size=bs,
                num_queries_per_kv=mc.num_attention_heads // mc.num_key_value_heads,
                num_kv_heads=mc.num_key_value_heads,
                num_pool_blocks=num_blocks + 1,
                device=engine.device,
                dtype=engine.dtype,
            )
            positions = torch.arange(start, start + len(piece))
            hidden = engine.model(torch.tensor(piece), positions, meta, pools)
            logits.append(engine.model.compute_logits(hidden).float())
        nll = torch.nn.functional.cross_entropy(torch.cat(logits), torch.tensor(ids[1:]))
    return math.exp(float(nll))


def agreement(baseline: list[list[int]], other: list[list[int]]) -> dict:
    prefixes, equal, total = [], 0, 0
    for a, b in zip(baseline, other, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefixes.append(n)
        equal += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(a)
    return {
        "mean_identical_prefix": statistics.mean(prefixes),
        "equal_positions": equal / total if total else 1.0,  # nothing generated: nothing differs
    }


def step_split(engine: LLMEngine, prompt: list[int], steps: int) -> dict:
    """Per decode step of one stream: wall ms, and ms inside weight GEMMs (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    engine.add_request("profiled", prompt, params)
    engine.step()  # prefill
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall_ms = (time.perf_counter() - t0) / steps * 1000
    while engine.has_unfinished():
        engine.step()
    gemms = [e for e in prof.key_averages() if e.key in WEIGHT_GEMMS]
    gemm_ms = sum(e.self_cpu_time_total for e in gemms) / 1000 / steps
    calls = {e.key: e.count / steps for e in sorted(gemms, key=lambda e: e.key)}
    return {"step_ms": wall_ms, "gemm_ms": gemm_ms, "other_ms": wall_ms - gemm_ms, "kernels": calls}


def sentence_prompts(tokenizer, text: str, num: int, length: int) -> list[list[int]]:
    sentences = [s.strip() for s in text.replace("\n", " ").split(". ") if len(s.split()) > 6]
    if len(sentences) < num:
        raise SystemExit(f"The bundled text has {len(sentences)} sentences; {num} are needed.")
    return [tokenizer.encode(s)[:length] for s in sentences[:num]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--modes", default="float32,w4a16,w4a8,w8a16,w8a8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-input-len", type=int, default=128)
    parser.add_argument("--batch-output-len", type=int, default=64)
    parser.add_argument("--quality-prompts", type=int, default=32)
    parser.add_argument(
        "--quality-batch",
        type=int,
        default=8,
        help="prompts decoded at once for agreement, and tokens per forward for perplexity "
        "(at most 16: the kernels a decode step runs)",
    )
    parser.add_argument("--quality-tokens", type=int, default=64)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--profile", action="store_true", help="step split, GEMMs vs the rest")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    # A float32 engine does not wait for the engine kernels' first build; build them now.
    kernels.available()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or BASELINE not in modes:
        parser.error(f"--modes takes {', '.join(MODES)} and must include {BASELINE}.")
    torch.set_num_threads(args.threads)

    keep_int4 = any(MODES[m][1] in INT4_MODES for m in modes)
    loaded = {"float32": load_model(args.model, dtype="float32", keep_int4=keep_int4)}
    if "bf16" in modes:
        loaded["bfloat16"] = load_model(args.model, dtype="bfloat16")
    seq_blocks = -(-(args.batch_input_len + args.batch_output_len) // 16) + 1
    engines = {}
    for mode in modes:
        dtype, quantization = MODES[mode]
        config = EngineConfig(
            model=args.model,
            dtype=dtype,
            device="cpu",
            num_threads=args.threads,
            quantization=quantization,
            num_blocks=max(args.batch, args.quality_prompts) * seq_blocks + 16,
            enable_prefix_caching=False,
        )
        engines[mode] = LLMEngine(config, loaded=loaded[dtype])
        if mode.endswith("-torch"):
            engine_kernels_off(engines[mode])
        if mode.endswith("-layers"):
            engines[mode].model.fused_decode = None
    tokenizer = engines[BASELINE].tokenizer
    text = TEXT.read_text()
    rng = np.random.default_rng(args.seed)
    vocab = engines[BASELINE].model_config.vocab_size
    report: dict = {"config": vars(args) | {"json": str(args.json)}, "modes": {}}
    for mode, engine in engines.items():
        report["modes"][mode] = {
            "weight_bytes_by_kind": engine.stats().weight_bytes_by_kind,
            "streamed_bytes": streamed_bytes(engine),
        }

    if not args.skip_speed:
        stream_prompt = tokenizer.encode(text)[:32]
        batch_prompts = rng.integers(100, vocab, (args.batch, args.batch_input_len)).tolist()
        for engine in engines.values():  # warm-up: first calls pack and allocate
            generate(engine, [stream_prompt, stream_prompt[:8]], 4)
        runs: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
        for r in range(args.repeats):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for mode in order:
                results = single_stream(engines[mode], stream_prompt, args.decode_tokens)
                results |= batch(engines[mode], batch_prompts, args.batch_output_len)
                for key, value in results.items():
                    runs[mode].setdefault(key, []).append(value)
                print(f"repeat {r + 1} {mode:<12} " + " ".join(
                    f"{k} {v:.1f}" for k, v in results.items()), flush=True)  # fmt: skip
        base_bytes = report["modes"][BASELINE]["streamed_bytes"]
        base = {k: statistics.median(v) for k, v in runs[BASELINE].items()}
        print(f"\nmedians of {args.repeats} alternating repeats, {args.threads} threads")
        print(
            f"{'mode':<12} {'MB/step':>8} {'decode tok/s':>13} {'TPOT p50 ms':>12} {'x base':>7}"
            f" {'bytes bound':>12} {'of bound':>9} {f'{args.batch}-way tok/s':>14} {'x base':>7}"
        )
        for mode in modes:
            med = {k: statistics.median(v) for k, v in runs[mode].items()}
            speedup = med["decode_tok_s"] / base["decode_tok_s"]
            bound = base_bytes / report["modes"][mode]["streamed_bytes"]
            batch_ratio = med["output_tok_s"] / base["output_tok_s"]
            report["modes"][mode] |= {
                "medians": med,
                "runs": runs[mode],
                "decode_speedup": speedup,
                "bytes_bound": bound,
                "fraction_of_bound": speedup / bound,
                "batch_speedup": batch_ratio,
            }
            print(
                f"{mode:<12} {report['modes'][mode]['streamed_bytes'] / 1e6:>8.1f}"
                f" {med['decode_tok_s']:>13.1f} {med['tpot_p50_ms']:>12.2f} {speedup:>6.2f}x"
                f" {bound:>11.2f}x {speedup / bound:>8.0%} {med['output_tok_s']:>14.1f}"
                f" {batch_ratio:>6.2f}x"
            )

    if not args.skip_quality:
        prompts = sentence_prompts(tokenizer, text, args.quality_prompts, 12)
        outputs = {
            m: [
                tokens
                for i in range(0, len(prompts), args.quality_batch)
                for tokens in generate(e, prompts[i : i + args.quality_batch], args.quality_tokens)[
                    "tokens"
                ]
            ]
            for m, e in engines.items()
        }
        ids = tokenizer.encode(text)
        print(f"\nquality: greedy agreement with {BASELINE} over the first {args.quality_tokens}"
              f" tokens of {len(prompts)} prompts, {args.quality_batch} at a time; perplexity of"
              f" {TEXT.name} ({len(ids)} tokens, {args.quality_batch} per forward)")  # fmt: skip
        print(f"{'mode':<12} {'identical prefix':>17} {'equal positions':>16} {'perplexity':>11}")
        for mode, engine in engines.items():
            quality = agreement(outputs[BASELINE], outputs[mode])
            quality["perplexity"] = perplexity(engine, ids, args.quality_batch)
            report["modes"][mode]["quality"] = quality
            print(
                f"{mode:<12} {quality['mean_identical_prefix']:>17.1f}"
                f" {quality['equal_positions']:>16.1%} {quality['perplexity']:>11.3f}"
            )

    if args.profile:
        prompt = tokenizer.encode(text)[:32]
        print("\nsingle-stream decode step split (torch.profiler), ms per step")
        print(f"{'mode':<12} {'step':>7} {'weight GEMMs':>13} {'other':>7}  kernels (calls/step)")
        for mode, engine in engines.items():
            split = step_split(engine, prompt, 16)
            report["modes"][mode]["step_split"] = split
            names = ", ".join(f"{k} {n:g}" for k, n in split["kernels"].items())
            print(
                f"{mode:<12} {split['step_ms']:>7.2f} {split['gemm_ms']:>13.2f}"
                f" {split['other_ms']:>7.2f}  {names}"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
