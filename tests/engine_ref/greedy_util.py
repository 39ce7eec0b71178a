"""Greedy generation through `LLMEngine.step`, shared by the engine tests."""

from __future__ import annotations

from engine_ref import LLMEngine, SamplingParams


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy output tokens, all admitted at once (`ignore_eos`)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].new_token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


def greedy_tokens_and_logprobs(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt's greedy output tokens and the logprob of each, all admitted at once
    (`ignore_eos`); no request may fail."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            new = out.outputs[0].new_token_ids
            tokens[out.request_id] += new
            recent = out.outputs[0].logprobs[-len(new) :]
            logprobs[out.request_id] += [d[t] for d, t in zip(recent, new, strict=True)]
    keys = [str(i) for i in range(len(prompts))]
    return [tokens[k] for k in keys], [logprobs[k] for k in keys]
