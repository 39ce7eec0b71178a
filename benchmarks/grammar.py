"""Grammar-constrained decoding: what a token mask costs per step, on SmolLM2-135M-Instruct's
vocabulary (49,152 tokens) and a five-field JSON schema.

Scenarios:
- `libraries`: xgrammar, llguidance and outlines-core (those installed), each given the same
  tokenizer (its vocabulary as raw bytes, or the tokenizer's JSON for llguidance): setup
  (vocabulary + schema compile) and the mask of every step of a valid output, filled one
  step at a time as an engine does (mean ms per step, median over rounds); the figures
  behind the library choice.
- `mask`: the engine's own masking path (`GrammarBackend`: fill each constrained row's
  bitmask, then apply it to the logits [B, V]) at batch 1 and 32, rows spread over the
  output's positions; ms per step.
- `step`: end to end, `LLMEngine.step` decode steps with and without the schema at batch 1 and
  32 (greedy, one engine, alternating order each round); median ms per decode step over the
  step positions both runs have with every request still running.

Rounds alternate the order of what they compare; tables give medians over `--rounds`.

    nice -n 19 python benchmarks/grammar.py                       # all three, 3 rounds
    nice -n 19 python benchmarks/grammar.py --scenarios libraries mask --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine_ref import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine_ref.core.grammar import GrammarBackend, GuidedDecoding, token_bytes  # noqa: E402
from engine_ref.loading.weights import load_model, load_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "city"],
    "additionalProperties": False,
}
# xgrammar and llguidance compact JSON differently; each is given the form its grammar takes.
INSTANCE = {"name": "Ada Lovelace of the analytical engine", "age": 36,
            "tags": ["math", "engines", "poetry"], "city": "Rome", "score": 3.25}  # fmt: skip


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        vocab = token_bytes(tokenizer)
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[2])
        self.compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False
        )
        self.bitmask = xgr.allocate_token_bitmask(1, len(vocab))
        self.text = json.dumps(INSTANCE)

    def steps(self, ids: list[int]) -> list[float]:
        matcher = self.xgr.GrammarMatcher(self.compiled)
        out = []
        for token in ids:
            out.append(_timed(lambda: matcher.fill_next_token_bitmask(self.bitmask)))
            assert matcher.accept_token(token)
        assert matcher.is_terminated()
        return out


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=2
        )
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
        )
        llguidance.LLMatcher(self.tokenizer, self.grammar)  # compiles
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        self.text = json.dumps(INSTANCE, separators=(",", ":"))

    def steps(self, ids: list[int]) -> list[float]:
        matcher = self.llg.LLMatcher(self.tokenizer, self.grammar)
        fill = self.llg.torch.fill_next_token_bitmask
        out = []
        for token in ids:
            out.append(_timed(lambda: fill(matcher, self.bitmask, 0)))
            assert matcher.consume_token(token), matcher.get_error()
        assert matcher.is_stopped() or matcher.is_accepting()
        return out


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, raw in enumerate(token_bytes(tokenizer)):
            if raw:
                by_bytes.setdefault(raw, []).append(token_id)
        vocabulary = outlines_core.Vocabulary(2, by_bytes)
        self.index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
        self.mask = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        self.text = json.dumps(INSTANCE)

    def steps(self, ids: list[int]) -> list[float]:
        guide = self.oc.Guide(self.index)
        mask = self.mask
        out = []
        for i, token in enumerate(ids):
            out.append(_timed(lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)))
            if i < len(ids) - 1:  # the end-of-sequence token: the guide is finished
                guide.advance(token)
        assert guide.is_finished()
        return out


MODULES = {
    "xgrammar": "xgrammar",
    "llguidance": "llguidance.torch",
    "outlines-core": "outlines_core",
}


def libraries(tokenizer, rounds: int) -> None:
    import importlib

    kinds = []
    for kind in (Xgrammar, Llguidance, OutlinesCore):
        try:
            imported = _timed(lambda kind=kind: importlib.import_module(MODULES[kind.name]))
        except ImportError as exc:
            print(f"{kind.name}: not installed ({exc})")
            continue
        setup = _timed(lambda kind=kind: kinds.append(kind(tokenizer)))
        kinds[-1].setup_s, kinds[-1].import_s = setup, imported
    results: dict[str, list[float]] = {k.name: [] for k in kinds}
    for r in range(rounds):
        for lib in kinds if r % 2 == 0 else kinds[::-1]:
            ids = tokenizer.encode(lib.text) + [2]
            times = lib.steps(ids)
            results[lib.name].append(statistics.mean(times) * 1e3)
    print(
        f"\nlibraries: one JSON-schema output of {len(ids)} steps, vocabulary {tokenizer.vocab_size}"
    )
    print("(import: first import in this process; setup: vocabulary + schema compile)")
    print(f"{'library':<15}{'import s':>9}{'setup ms':>10}{'mask ms/step':>14}")
    for lib in kinds:
        mean = statistics.median(results[lib.name])
        print(f"{lib.name:<15}{lib.import_s:>9.2f}{lib.setup_s * 1e3:>10.1f}{mean:>14.4f}")


def _matchers_at(backend: GrammarBackend, ids: list[int], batch: int) -> list:
    """`batch` matchers, row i advanced by the first (i * len // batch) tokens of `ids`."""
    guided = GuidedDecoding.json_schema(SCHEMA)
    out = []
    for i in range(batch):
        matcher = backend.matcher(guided)
        for token in ids[: i * (len(ids) - 1) // max(batch, 1)]:
            matcher.accept(token)
        out.append(matcher)
    return out


def mask(tokenizer, rounds: int) -> None:
    backend = GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    ids = tokenizer.encode(json.dumps(INSTANCE))
    print("\nmask: the engine's masking of one step (fill + apply), logits [B, 49152] float32")
    print(f"{'batch':>6}{'fill ms':>10}{'apply ms':>10}{'total ms':>10}")
    for batch in (1, 32):
        matchers = _matchers_at(backend, ids, batch)
        fills, applies = [], []
        for _ in range(rounds * 20):
            logits = torch.randn(batch, tokenizer.vocab_size)
            bitmask = backend.allocate(batch)
            start = time.perf_counter()
            for row, matcher in enumerate(matchers):
                matcher.fill(bitmask, row)
            filled = time.perf_counter()
            backend.apply(logits, bitmask, list(range(batch)))
            fills.append(filled - start)
            applies.append(time.perf_counter() - filled)
        fill, apply = statistics.median(fills) * 1e3, statistics.median(applies) * 1e3
        print(f"{batch:>6}{fill:>10.3f}{apply:>10.3f}{fill + apply:>10.3f}")


def _decode_steps(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Seconds of each decode step with every request still running, in order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    times = []
    while engine.has_unfinished():
        prefilling = any(
            s.num_computed_tokens < s.num_prompt_tokens
            for r in engine.requests.values()
            for s in r.sequences
        )
        running = sum(1 for r in engine.requests.values() for s in r.sequences if not s.is_finished)
        elapsed = _timed(engine.step)
        if not prefilling and running == len(prompts):  # full decode batches only
            times.append(elapsed)
    return times


def step(rounds: int, max_tokens: int) -> None:
    loaded = load_model("smollm2-135m", dtype="float32")
    tok = loaded.tokenizer
    config = EngineConfig(
        model="smollm2-135m", dtype="float32", kv_cache_memory_bytes=256 << 20, num_threads=1
    )
    engine = LLMEngine(config, loaded=loaded)
    questions = ["Describe a person as JSON.", "Give me a JSON record of a city.",
                 "Write a JSON profile of a scientist.", "Make up a user record in JSON."]  # fmt: skip
    print(f"\nstep: SmolLM2 decode step, greedy, {max_tokens} tokens, median ms per full step")
    print(f"{'batch':>6}{'plain ms':>10}{'guided ms':>11}{'diff ms':>9}")
    guided = GuidedDecoding.json_schema(SCHEMA)
    for batch in (1, 32):
        prompts = [
            tok.encode(tok.apply_chat_template([{"role": "user", "content": questions[i % 4]}]))
            for i in range(batch)
        ]
        modes = {
            "plain": SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
            "guided": SamplingParams(max_tokens=max_tokens, temperature=0, guided=guided),
        }
        results: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(rounds):
            steps = {}
            for name in list(modes) if r % 2 == 0 else list(modes)[::-1]:
                steps[name] = _decode_steps(engine, prompts, modes[name])
            # The same step positions (context lengths) in both: guided outputs end sooner.
            common = min(len(t) for t in steps.values())
            for name, times in steps.items():
                results[name].append(statistics.median(times[:common]) * 1e3)
        plain, masked = (statistics.median(results[m]) for m in modes)
        print(f"{batch:>6}{plain:>10.2f}{masked:>11.2f}{masked - plain:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=["libraries", "mask", "step"],
                        choices=["libraries", "mask", "step"])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (medians of alternating rounds).")
    torch.set_num_threads(1)  # the step scenario's engine uses one thread too
    tokenizer = load_tokenizer("smollm2-135m")
    if "libraries" in args.scenarios:
        libraries(tokenizer, args.rounds)
    if "mask" in args.scenarios:
        mask(tokenizer, args.rounds)
    if "step" in args.scenarios:
        step(args.rounds, args.max_tokens)


if __name__ == "__main__":
    main()
