"""Speculative decoding on and off, side by side in one process, on SmolLM2-135M-Instruct.

Scenarios (greedy, one engine per mode built from the same loaded weights):
- `single`: single-request decode on a repetition-heavy prompt set (chat prompts asking to
  repeat, or lightly edit, a given text), one request at a time; output tokens / s over the
  set, plus acceptance rate and mean accepted length.
- `batch32`: the same prompts as 32 concurrent requests, speculation configured with its
  automatic off-switch (`disable_by_batch_size`, default 8).
- `self_chat`: the built-in `chat` workload's first prompts, one at a time, with the
  self-speculative draft (the target's first `--self-draft-layers` layers) instead of n-gram.
- `tree`: the `single` prompts with n-gram chain drafts as the baseline ("off") against
  n-gram token trees of `--tree-branches` continuations ("on"), same token budget.

Each round runs "off" then "on" (alternating order every round), `--rounds` times (at least
3); the table gives medians and the on / off ratio. Both modes must produce identical
outputs (checked every round).

    nice python benchmarks/spec_decode.py                         # both scenarios, 3 rounds
    nice python benchmarks/spec_decode.py --scenarios single --rounds 5 --max-tokens 96
    nice python benchmarks/spec_decode.py --scenarios single,batch32 --quantization w4a16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ref import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_ref.core import kernels  # noqa: E402
from engine_ref.core.engine_config import SpeculativeConfig  # noqa: E402
from engine_ref.loading.weights import load_model  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the "
    "clocks were striking thirteen. The fox ran into the forest and hid under a large oak.",
    "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
    "def sub(a, b):\n    return a - b\n",
    "Dear team, the meeting on Monday is moved to Tuesday at 10 am in room 4B. Please bring "
    "your quarterly reports and the budget figures for the next year.",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is "
    "lower, so water boils at a lower temperature, which makes cooking take longer.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy this text, replacing every full stop with an exclamation mark:\n\n{}",
]


def prompts(tokenizer) -> list[list[int]]:
    out = []
    for instruction in INSTRUCTIONS:
        for text in TEXTS:
            messages = [{"role": "user", "content": instruction.format(text)}]
            out.append(tokenizer.encode(tokenizer.apply_chat_template(messages)))
    return out


def run(engine: LLMEngine, batch: list[list[int]], max_tokens: int, concurrent: bool) -> dict:
    """Decode `batch` (all at once, or one request after another); returns output tokens,
    seconds, decode tokens and seconds (after each group's first step that emitted a token:
    prefill excluded), and the tokens of each request."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outputs: dict[str, list[int]] = {}
    decode_tokens = 0
    decode_s = 0.0
    t0 = time.perf_counter()
    groups = [batch] if concurrent else [[p] for p in batch]
    n = 0
    for group in groups:
        for prompt in group:
            rid = f"r{n}"
            n += 1
            outputs[rid] = []
            engine.add_request(rid, prompt, params)
        t_first = None
        while engine.has_unfinished():
            emitted = 0
            for out in engine.step():
                outputs[out.request_id] += out.outputs[0].new_token_ids
                emitted += len(out.outputs[0].new_token_ids)
            if t_first is None and emitted:
                t_first = time.perf_counter()
            elif t_first is not None:
                decode_tokens += emitted
        if t_first is not None:
            decode_s += time.perf_counter() - t_first
    seconds = time.perf_counter() - t0
    return {
        "tokens": sum(map(len, outputs.values())),
        "seconds": seconds,
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default="single,batch32,self_chat,tree")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--self-draft-layers", type=int, default=10)
    parser.add_argument("--tree-branches", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--quantization", default=None, help="w4a16, w8a16 or w8a8 for every engine (default: none)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    # A float32 engine does not wait for the engine kernels' first build; build them now.
    kernels.available()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (medians of alternating runs).")
    loaded = load_model("smollm2-135m", dtype="float32", keep_int4=args.quantization == "w4a16")
    spec = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=4,
        prompt_lookup_min=2,
    )
    base = dict(model="smollm2-135m", dtype="float32", device="cpu", num_threads=args.threads,
                kv_cache_memory_bytes=1 << 30, quantization=args.quantization)  # fmt: skip
    self_draft = SpeculativeConfig(
        method="self_draft",
        num_speculative_tokens=args.num_speculative_tokens,
        num_draft_layers=args.self_draft_layers,
    )
    off = LLMEngine(EngineConfig(**base), loaded=loaded)
    ngram = LLMEngine(EngineConfig(**base, speculative_config=spec), loaded=loaded)
    prompt_set = prompts(loaded.tokenizer)[: args.num_prompts]
    scenarios = {
        "single": (prompt_set, False, off, ngram),
        "batch32": ((prompt_set * 32)[:32], True, off, ngram),
    }
    if "tree" in args.scenarios:
        tree = dataclasses.replace(spec, num_tree_branches=args.tree_branches)
        tree_engine = LLMEngine(EngineConfig(**base, speculative_config=tree), loaded=loaded)
        scenarios["tree"] = (prompt_set, False, ngram, tree_engine)
    if "self_chat" in args.scenarios:
        from workloads.options import WorkloadOptions
        from workloads.registry import resolve_workload

        chat = resolve_workload(
            "chat",
            options=WorkloadOptions(num_requests=args.num_prompts),
            tokenizer=loaded.tokenizer,
            use_cache=False,
        )
        chat_prompts = [list(p)[:256] for p in chat.table.column("prompt_token_ids").to_pylist()]
        self_engine = LLMEngine(EngineConfig(**base, speculative_config=self_draft), loaded=loaded)
        scenarios["self_chat"] = (chat_prompts, False, off, self_engine)
    header = f"{'scenario':<10}{'reqs':>5}{'off tok/s':>11}{'on tok/s':>10}{'on/off':>8}"
    print(header + f"{'accept':>8}{'mean len':>10}{'decode on/off':>15}", flush=True)
    rows = []
    for name in args.scenarios.split(","):
        batch, concurrent, off_engine, on_engine = scenarios[name]
        engines = {"off": off_engine, "on": on_engine}
        rates: dict[str, list[float]] = {"off": [], "on": []}
        decode_rates: dict[str, list[float]] = {"off": [], "on": []}
        spec_before = engines["on"].stats().spec_decode
        for r in range(args.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            results = {mode: run(engines[mode], batch, args.max_tokens, concurrent)
                       for mode in order}  # fmt: skip
            same = list(results["on"]["outputs"].values()) == list(
                results["off"]["outputs"].values()
            )
            if not same:
                print(f"warning: {name} round {r}: outputs differ between on and off")
            for mode in order:
                rates[mode].append(results[mode]["tokens"] / results[mode]["seconds"])
                decode_s = results[mode]["decode_s"]
                decode_rates[mode].append(results[mode]["decode_tokens"] / decode_s)
        spec_after = engines["on"].stats().spec_decode
        drafts = spec_after.num_drafts - spec_before.num_drafts
        draft_tokens = spec_after.num_draft_tokens - spec_before.num_draft_tokens
        accepted = spec_after.num_accepted_tokens - spec_before.num_accepted_tokens
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        rows.append(
            {
                "scenario": name,
                "requests": len(batch),
                "off_tok_s": off,
                "on_tok_s": on,
                "ratio": on / off,
                "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
                "rounds_off": rates["off"],
                "rounds_on": rates["on"],
                "decode_ratio": statistics.median(decode_rates["on"])
                / statistics.median(decode_rates["off"]),
                "decode_rounds_off": decode_rates["off"],
                "decode_rounds_on": decode_rates["on"],
            }
        )
        row = rows[-1]
        print(
            f"{row['scenario']:<10}{row['requests']:>5}{row['off_tok_s']:>11.1f}"
            f"{row['on_tok_s']:>10.1f}{row['ratio']:>7.2f}x{row['acceptance_rate']:>8.2f}"
            f"{row['mean_accepted_length']:>10.2f}{row['decode_ratio']:>14.2f}x",
            flush=True,
        )
    print(f"medians of {args.rounds} alternating rounds; max_tokens {args.max_tokens}, greedy;")
    print("accept / mean len: the 'on' engine's; tree: off = n-gram chains, on = n-gram trees")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
