"""Prefill/decode across two tiny-random engines, shared by the KV handoff and KV link tests."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from engine_ref import EngineConfig, LLMEngine, SamplingParams
from engine_ref.core import kv_handoff
from engine_ref.core.kv_handoff import HandoffExporter, KVHandoff
from engine_ref.core.outputs import RequestOutput

# logprobs=5: tiny-random's greedy tokens repeat, but the top-5 alternatives' logprobs move
# with every KV value, so comparing them checks the installed KV, not just the argmax.
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
# Temperature 20 spreads tiny-random's peaked distribution, so a seeded draw depends on the logits.
SEEDED = SamplingParams(max_tokens=10, temperature=20.0, seed=3, ignore_eos=True)
MAX_STEPS = 200  # a loop that runs longer is a stuck engine (blocks leaked, say)


def make(tiny_model, **overrides) -> LLMEngine:
    options = dict(model="tiny-random", dtype="float32", device="cpu", num_blocks=32,
                   block_size=16, num_threads=1)  # fmt: skip
    options.update(overrides)
    return LLMEngine(EngineConfig(**options), loaded=tiny_model)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 1000 + length)
    return [rng.randrange(3, 512) for _ in range(length)]


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)

    def add(self, output: RequestOutput) -> None:
        completion = output.outputs[0]
        self.tokens += completion.new_token_ids
        self.logprobs += completion.logprobs or []
        self.finish_reasons.append(completion.finish_reason)


def run_single(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> Generation:
    engine.add_request("single", prompt, params)
    return run_to_end(engine, Generation())


def prefill(
    exporter: HandoffExporter, request_id: str, prompt: list[int], params: SamplingParams
) -> tuple[Generation, KVHandoff]:
    """Run the prompt on the exporter's engine until the first token is out; its export."""
    exporter.add_request(request_id, prompt, params)
    generation = Generation()
    for _ in range(MAX_STEPS):
        for output in exporter.step():
            generation.add(output)
        if request_id in exporter.held:
            return generation, exporter.export(request_id)
    raise AssertionError(f"{request_id!r} did not sample its first token in {MAX_STEPS} steps")


def run_to_end(engine: LLMEngine, generation: Generation) -> Generation:
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            return generation
        for output in engine.step():
            generation.add(output)
    raise AssertionError(f"the engine did not finish in {MAX_STEPS} steps")


def decode(
    engine: LLMEngine, handoff: KVHandoff, params: SamplingParams, generation: Generation
) -> Generation:
    kv_handoff.install(engine, handoff.request_id, handoff, params)
    return run_to_end(engine, generation)


def assert_idle(*engines: LLMEngine) -> None:
    for engine in engines:
        stats = engine.stats()
        assert stats.num_blocks_free == stats.num_blocks_total
        assert not engine.has_unfinished() and not engine.scheduler.running
