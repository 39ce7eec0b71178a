"""Next-token sampling for a batch of logits rows, vectorised where rows share a method.

Greedy rows take one argmax together. Random rows are scaled by their temperatures, filtered by
top-k and top-p (batched over the rows that ask), then sampled by inverting their cumulative
distribution with one uniform draw per row (`inverse_cdf`): rows with a seed draw theirs from
their own `torch.Generator`, so a seeded request reproduces whatever else is in the batch.

One uniform a row, not one random number per vocabulary entry: the exponential race this
replaced (argmax of p / E, E ~ Exp(1)) drew 49,152 exponentials a row, and torch's CPU
`exponential_` took 49 ms for a 64-row step of SmolLM2 on this project's AMD EPYC (2 threads),
about as long as the model's forward; the cumulative sum and a binary search take 1.4 ms
(`benchmarks/sampler.py` times the two draws side by side: 71.5 against 2.6 ms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_ref.core.engine_config import SamplingParams

_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SampleRow:
    """What one logits row needs: its parameters, its seeded generator (or None), and token
    ids it may not sample yet (end-of-sequence ids while below min_tokens)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    banned_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: None, or {token_id: logprob} holding the sampled token and the top-k alternatives.
    logprobs: list[dict[int, float] | None]


def sample(
    logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator | None = None
) -> SamplerOutput:
    """Sample one token per row of logits [N, V] (any float dtype; modified in place where
    tokens are banned). `generator` drives unseeded rows. Everything is computed in float32,
    greedy argmax included: upcasting preserves order, and torch's CPU argmax over bfloat16
    is slow (5.8 ms of a 148 ms 64-way decode step in `benchmarks/engine_throughput.py
    --profile`; the upcast plus a float32 argmax of the same [64, 49152] took 1.8 ms)."""
    num_rows = logits.shape[0]
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            logits[i, list(row.banned_token_ids)] = float("-inf")

    logits = logits.float()
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    if len(greedy) == num_rows:
        token_ids = logits.argmax(dim=-1).tolist()
        if all(r.params.logprobs is None for r in rows):
            return SamplerOutput(token_ids, [None] * num_rows)
        return SamplerOutput(token_ids, token_logprobs(logits, rows, token_ids))
    tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    if greedy:
        index = torch.tensor(greedy, device=logits.device, dtype=torch.long)
        tokens[index] = logits.index_select(0, index).argmax(dim=-1)
    random = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    index = torch.tensor(random, device=logits.device, dtype=torch.long)
    probs = filtered_probs(logits.index_select(0, index), [rows[i].params for i in random])
    uniforms = _uniforms([rows[i].generator for i in random], generator, probs.device)
    tokens[index] = inverse_cdf(probs, uniforms)
    token_ids = tokens.tolist()
    return SamplerOutput(token_ids, token_logprobs(logits, rows, token_ids))


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities [R, V] after temperature, top-k and top-p."""
    device = logits.device
    vocab = logits.shape[-1]
    # A temperature beyond float32's range would become inf, and -inf / inf is NaN.
    temps = [min(p.temperature, _FLOAT32_MAX) for p in params]
    logits = logits / torch.tensor(temps, device=device, dtype=logits.dtype)[:, None]
    # top_k at or beyond the vocabulary keeps every token (and stays within int64).
    top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_ks):
        ks = torch.tensor([k or vocab for k in top_ks], device=device, dtype=torch.long)
        kmax = max(k or vocab for k in top_ks)
        top_values = logits.topk(kmax, dim=-1).values  # [R, kmax], descending
        threshold = top_values.gather(1, (ks.clamp(max=kmax) - 1)[:, None])
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        ps = torch.tensor(top_ps, device=device, dtype=logits.dtype)
        drop_sorted = mass_before >= ps[:, None]
        drop_sorted[:, 0] = False  # a top_p that rounds to 0 in float32 keeps the top token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of probs [R, V] (non-negative, summing to about 1) the token its uniform draw
    u in [0, 1) selects: the first whose cumulative probability reaches (1 - u) times the row's
    total. The target lies in (0, total], so a token of probability 0 (filtered, banned) is
    never chosen, at either end of the row: its cumulative sum equals its predecessor's."""
    cdf = probs.cumsum(dim=-1)
    target = (1.0 - uniforms).to(cdf.dtype)[:, None] * cdf[:, -1:]  # 1 - u in float64: > 0
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _uniforms(
    generators: list[torch.Generator | None],
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """One uniform in [0, 1) per row: a seeded row's from its own generator, the others' from
    `generator`, in one draw."""
    draw = dict(dtype=torch.float64, device=device)
    uniforms = torch.empty(len(generators), **draw)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), generator=generator, **draw)
    for i, g in enumerate(generators):
        if g is not None:
            uniforms[i] = torch.rand(1, generator=g, **draw)[0]
    return uniforms


def sample_one(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One sample of probs [V]: the draw `sample` makes for one seeded row (one uniform)."""
    uniform = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device)
    return int(inverse_cdf(probs[None], uniform)[0])


def token_logprobs(
    logits: torch.Tensor, rows: list[SampleRow], token_ids: list[int]
) -> list[dict[int, float] | None]:
    """Per row asking for logprobs: the sampled token's and the top-k tokens' logprobs under
    the model's distribution (before temperature and filtering)."""
    result: list[dict[int, float] | None] = [None] * len(rows)
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return result
    index = torch.tensor(wanted, device=logits.device, dtype=torch.long)
    log_probs = logits.index_select(0, index).log_softmax(dim=-1)  # [W, V]
    sampled = torch.tensor([token_ids[i] for i in wanted], device=logits.device)
    sampled_values = log_probs.gather(1, sampled[:, None]).squeeze(1).tolist()
    kmax = min(max(rows[i].params.logprobs for i in wanted), log_probs.shape[-1])
    top_values, top_ids = (t.tolist() for t in log_probs.topk(max(kmax, 1), dim=-1))
    for j, i in enumerate(wanted):
        k = rows[i].params.logprobs
        entry = {token_ids[i]: sampled_values[j]}
        for token, value in zip(top_ids[j][:k], top_values[j][:k], strict=True):
            entry.setdefault(token, value)
        result[i] = entry
    return result
