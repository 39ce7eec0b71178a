"""The reference engine on a CUDA device against the CPU engine and torch's bf16 matmul floor.

Nothing is downloaded: every model here is built in-process.

- equality: greedy outputs of `EQUALITY_PROMPTS` (`--max-tokens` each, one batch) on the device
  against the CPU engine, both float32 (the device side's dtype is `--device-dtype`), on
  tiny-random and on `tiny-random-varied`: the same weights with the embedding scaled by 0.1
  and the o/down projections by 3, whose greedy continuations change token often (stock
  tiny-random mostly repeats one token, an easy test). Per prompt: equal or not, the first
  differing token, the CPU's top-2 log-probability margin there (a near tie flips on any
  rounding; a wide margin is a bug) and the largest difference of the sampled tokens'
  log-probabilities over the common prefix.
- speed: decode tokens/s through `LLMEngine.step` at each `--batches` size (16-token random
  prompts, `--steps` timed steps after 2 warm-up steps, the median step), in `--speed-dtype`,
  on a model of SmolLM2-135M's shape with seeded random weights (`--shape tiny` for
  tiny-random's shape), beside the floor: the time of the same model's matmuls alone in bf16
  (the engine's fused shapes, distinct weights per layer so the weights do not stay in
  cache, then the output head), timed with CUDA events on CUDA. /work/shared/tools/gemm_floor.py
  measures the same floor on the CPU with unfused shapes and one layer's weights reused.

    python benchmarks/gpu_check.py                                # on CUDA, batches 1 and 64
    python benchmarks/gpu_check.py --json gpu.json --steps 64
    python benchmarks/gpu_check.py --device cpu --shape tiny --steps 4   # the same path on CPU

Exits 0 when everything ran and the greedy outputs are equal, 1 when they differ or a part
failed (the others still run), 2 when CUDA is asked for and absent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ref import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_ref.core.config import ModelConfig  # noqa: E402
from engine_ref.loading.auto_dtype import decode_step_seconds  # noqa: E402
from engine_ref.loading.tiny_random import (  # noqa: E402
    build_tiny_tokenizer,
    tiny_random_config,
    tiny_random_state_dict,
)
from harness.run.environment import hardware_info  # noqa: E402

EQUALITY_PROMPTS = (
    "The capital of France is",
    "def main(): return sum(x * x for x in",
    "Requests arrive at random times; a scheduler batches them",
    "Café, naïve, résumé, Zürich",
)
SPEED_PROMPT_TOKENS = 16
WARMUP_STEPS = 2
FLOOR_REPEATS = 5
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    rope_theta=100000.0,
    max_position_embeddings=8192,
)


def tiny_models() -> dict[str, SimpleNamespace]:
    """tiny-random (float32) and its varied variant, as the engine takes them."""
    tokenizer = build_tiny_tokenizer()
    config = tiny_random_config(tokenizer.vocab_size)
    stock = tiny_random_state_dict(config)
    varied = dict(stock)
    varied["model.embed_tokens.weight"] = stock["model.embed_tokens.weight"] * 0.1
    for name, t in stock.items():
        if "o_proj" in name or "down_proj" in name:
            varied[name] = t * 3
    return {
        "tiny-random": SimpleNamespace(config=config, state_dict=stock, tokenizer=tokenizer),
        "tiny-random-varied": SimpleNamespace(
            config=config, state_dict=varied, tokenizer=tokenizer
        ),
    }


def speed_config(shape: str) -> ModelConfig:
    """SmolLM2-135M's shape ("smollm2") or tiny-random's ("tiny")."""
    if shape == "smollm2":
        return ModelConfig(**SMOLLM2_SHAPE, tie_word_embeddings=True, eos_token_id=2)
    return tiny_random_config(build_tiny_tokenizer().vocab_size)


def speed_model(shape: str) -> SimpleNamespace:
    """A model of `speed_config(shape)` with seeded random weights, and the tiny tokenizer
    (the ids it lacks detokenize to nothing)."""
    config = speed_config(shape)
    return SimpleNamespace(
        config=config, state_dict=tiny_random_state_dict(config), tokenizer=build_tiny_tokenizer()
    )


def engine_on(loaded, device: str, dtype: str, *, rows: int, tokens_per_row: int, threads=None):
    block_size = 16
    num_blocks = rows * (-(-tokens_per_row // block_size) + 1) + 1
    config = EngineConfig(
        model="gpu-check",
        device=device,
        dtype=dtype,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max(rows, 1),
        enable_prefix_caching=False,
        num_threads=threads,
    )
    return LLMEngine(config, loaded=loaded)


def greedy_run(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> list[list[tuple[int, dict]]]:
    """Per prompt, (token, {token: logprob} of the top 2 and the sampled) for each step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    steps: dict[str, list[tuple[int, dict]]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            done = out.outputs[0]
            steps[out.request_id] += list(zip(done.new_token_ids, done.logprobs or [], strict=True))
    return [steps[str(i)] for i in range(len(prompts))]


def compare(
    reference: list[list[tuple[int, dict]]], device: list[list[tuple[int, dict]]], texts
) -> dict:
    """Equality of two `greedy_run`s, prompt by prompt."""
    rows = []
    for text, ref, dev in zip(texts, reference, device, strict=True):
        ref_ids, dev_ids = [t for t, _ in ref], [t for t, _ in dev]
        first = next(
            (i for i, (a, b) in enumerate(zip(ref_ids, dev_ids, strict=False)) if a != b), None
        )
        if first is None and len(ref_ids) != len(dev_ids):
            first = min(len(ref_ids), len(dev_ids))
        common = len(ref_ids) if first is None else first
        diffs = [abs(ref[i][1][ref_ids[i]] - dev[i][1][dev_ids[i]]) for i in range(common)]
        margin = None
        if first is not None and first < len(ref):
            top = sorted(ref[first][1].values(), reverse=True)
            margin = top[0] - top[1] if len(top) > 1 else None
        rows.append({
            "prompt": text,
            "equal": first is None,
            "first_divergence": first,
            "cpu_top2_margin_at_divergence": margin,
            "max_abs_logprob_diff": max(diffs, default=0.0),
            "tokens": len(ref_ids),
        })  # fmt: skip
    return {"equal": all(r["equal"] for r in rows), "prompts": rows}


def check_equality(device: str, device_dtype: str, max_tokens: int, threads) -> dict:
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("highest")  # no TF32: float32 means float32
    models = {}
    for name, loaded in tiny_models().items():
        prompts = [loaded.tokenizer.encode(text) for text in EQUALITY_PROMPTS]
        rows, tokens = len(prompts), max(map(len, prompts)) + max_tokens
        cpu = engine_on(loaded, "cpu", "float32", rows=rows, tokens_per_row=tokens, threads=threads)
        dev = engine_on(
            loaded, device, device_dtype, rows=rows, tokens_per_row=tokens, threads=threads
        )
        models[name] = compare(
            greedy_run(cpu, prompts, max_tokens),
            greedy_run(dev, prompts, max_tokens),
            EQUALITY_PROMPTS,
        )
    return {
        "reference": "cpu float32",
        "device_dtype": device_dtype,
        "max_tokens": max_tokens,
        "prompts": list(EQUALITY_PROMPTS),
        "models": models,
        "greedy_equal": all(m["equal"] for m in models.values()),
    }


def decode_speed(loaded, device: str, dtype: str, batches: list[int], steps: int, threads) -> dict:
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prompts = torch.randint(3, vocab, (max(batches), SPEED_PROMPT_TOKENS), generator=gen).tolist()
    tokens = SPEED_PROMPT_TOKENS + WARMUP_STEPS + steps + 3
    engine = engine_on(
        loaded, device, dtype, rows=max(batches), tokens_per_row=tokens, threads=threads
    )
    out = {}
    for b in batches:
        seconds = decode_step_seconds(
            {dtype: engine}, prompts[:b], b, warmup=WARMUP_STEPS, rounds=1, steps_per_round=steps
        )[dtype]
        step_s = statistics.median(seconds)
        out[b] = {"step_ms": 1000 * step_s, "tok_s": b / step_s, "steps": len(seconds)}
    return out


def matmul_floor(config: ModelConfig, device: str, batches: list[int]) -> dict:
    """Per batch size: the time of one decode step's matmuls alone (bf16, the engine's fused
    shapes, each layer its own weights, then the output head)."""
    h, i, q = (
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads * config.head_dim,
    )
    qkv = q + 2 * config.num_key_value_heads * config.head_dim
    shapes = [(qkv, h), (h, q), (2 * i, h), (h, i)]  # [out, in]: qkv, o, gate_up, down
    gen = torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen).to(device, torch.bfloat16)

    layers = [[weight(o, k) for o, k in shapes] for _ in range(config.num_hidden_layers)]
    head = weight(config.vocab_size, h)
    flops_per_row = 2 * (
        config.num_hidden_layers * sum(o * k for o, k in shapes) + config.vocab_size * h
    )

    def step(x: torch.Tensor) -> torch.Tensor:  # x [B, H]
        for w_qkv, w_o, w_gate_up, w_down in layers:
            attn = (x @ w_qkv.T)[:, :q]  # [B, Hq * D], standing in for attention's output
            x = attn @ w_o.T  # [B, H]
            x = (x @ w_gate_up.T)[:, :i] @ w_down.T  # [B, H]
        return x @ head.T  # [B, V]

    out = {}
    for b in batches:
        x = torch.randn(b, h, generator=gen).to(device, torch.bfloat16)
        times = [_timed(step, x, device) for _ in range(2 + FLOOR_REPEATS)][2:]
        floor_s = statistics.median(times)
        out[b] = {
            "floor_ms": 1000 * floor_s,
            "floor_tok_s": b / floor_s,
            "floor_tflops": flops_per_row * b / floor_s / 1e12,
        }
    return out


def _timed(fn, x: torch.Tensor, device: str) -> float:
    """Seconds of `fn(x)`: CUDA events around it on CUDA, the wall clock elsewhere."""
    if not device.startswith("cuda"):
        t0 = time.perf_counter()
        fn(x)
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


def environment(device: str, threads) -> dict:
    env = {
        "device": device,
        "torch": torch.__version__,
        "cpu": hardware_info()["cpu"],
        "cpu_threads": threads or torch.get_num_threads(),
    }
    if device.startswith("cuda"):
        env["device_name"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    return env


def run(args: argparse.Namespace) -> dict:
    """Every part, each recorded under its name or, when it raised, under `errors`."""
    result: dict = {"environment": environment(args.device, args.threads), "errors": {}}
    parts = {
        "equality": lambda: check_equality(args.device, args.device_dtype, args.max_tokens, args.threads),
        "speed": lambda: decode_speed(speed_model(args.shape), args.device, args.speed_dtype, args.batches, args.steps, args.threads),
        "floor": lambda: matmul_floor(speed_config(args.shape), args.device, args.batches),
    }  # fmt: skip
    for name, part in parts.items():
        try:
            result[name] = part()
        except Exception as exc:  # one failed part must not cost the others' figures
            traceback.print_exc()
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
    result["speed_shape"] = args.shape
    result["speed_dtype"] = args.speed_dtype
    return result


def render(result: dict) -> str:
    env = result["environment"]
    where = env.get("device_name") or env["cpu"]
    lines = [f"gpu_check on {env['device']} ({where}), torch {env['torch']}"]
    eq = result.get("equality")
    if eq is not None:
        lines.append(
            f"greedy equality, {eq['device_dtype']} on the device against {eq['reference']}, {eq['max_tokens']} tokens:"
        )
        for model, m in eq["models"].items():
            for row in m["prompts"]:
                verdict = "equal" if row["equal"] else f"differs at token {row['first_divergence']}"
                margin = row["cpu_top2_margin_at_divergence"]
                extra = f" (CPU top-2 margin {margin:.3g})" if margin is not None else ""
                lines.append(
                    f"  {model:<19} {row['prompt'][:40]!r:<44} {verdict}{extra}, max |d logprob| {row['max_abs_logprob_diff']:.2e}"
                )
        lines.append(f"  all equal: {eq['greedy_equal']}")
    speed, floor = result.get("speed"), result.get("floor")
    if speed is not None or floor is not None:
        lines.append(f"decode, {result['speed_shape']} shape, {result['speed_dtype']}:")
        lines.append(
            f"  {'batch':>5} {'ms/step':>9} {'tok/s':>10} {'floor ms':>9} {'floor tok/s':>12} {'of floor':>9}"
        )
        for b in sorted(set(speed or {}) | set(floor or {})):
            s, f = (speed or {}).get(b, {}), (floor or {}).get(b, {})
            share = s["tok_s"] / f["floor_tok_s"] if s and f else None
            lines.append(
                f"  {b:>5} {_num(s.get('step_ms')):>9} {_num(s.get('tok_s')):>10} "
                f"{_num(f.get('floor_ms')):>9} {_num(f.get('floor_tok_s')):>12} "
                f"{'-' if share is None else f'{share:.1%}':>9}"
            )
    for name, error in result["errors"].items():
        lines.append(f"{name} failed: {error}")
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument(
        "--device-dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the device engine's dtype in the equality check (the CPU's is float32)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=24, help="greedy tokens per equality prompt"
    )
    parser.add_argument(
        "--shape", default="smollm2", choices=("smollm2", "tiny"), help="the speed model's shape"
    )
    parser.add_argument(
        "--speed-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16")
    )
    parser.add_argument("--batches", default="1,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    try:
        args.batches = sorted({int(b) for b in args.batches.split(",")})
    except ValueError:
        parser.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if min(args.batches) < 1 or args.steps < 1 or args.max_tokens < 1:
        parser.error("--batches, --steps and --max-tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"CUDA was asked for (--device {args.device}) but torch {torch.__version__} sees no CUDA device; run with --device cpu to check the same path on the CPU.",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    print(render(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    equal = result.get("equality", {}).get("greedy_equal", False)
    return 0 if equal and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
