"""Verification of drafted tokens against the target model's logits, one forward per draft.

A chain draft d_1..d_k for a sequence is scored by feeding [last token, d_1..d_k]; logits row
j is the target's distribution p_j for the token after d_j (row 0: after the last token).

- Greedy rows accept d_{j+1} while it equals argmax(row j); the first mismatch emits that
  argmax, and when all k are accepted the argmax of row k is a bonus token.
- Sampled rows use the standard rule (Leviathan et al. 2023, Chen et al. 2023): accept
  d_{j+1} with probability min(1, p_j(d) / q_j(d)); on rejection emit a sample of the
  normalised max(0, p_j - q_j) and stop; when all k are accepted sample a bonus token from
  p_k. p and q are the temperature / top-k / top-p filtered distributions, computed by the
  sampler's own `filtered_probs`, so the rule sees what non-speculative sampling samples from.
  The emitted tokens are then distributed exactly as non-speculative samples.
- Point drafts (n-gram lookup, greedy drafters: q is one-hot at d) take the accept test and
  the residual sample from one sample t of p, the draw the non-speculative sampler makes for
  that position (`sampler.sample_one`: one uniform from the row's generator). The event
  t == d has probability p(d) = min(1, p(d) / 1), and given t != d, t is distributed as p
  with d removed and renormalised, which is max(0, p - q) normalised. Each emitted token
  consumes exactly one draw, in order, so a seeded request draws the same numbers as without
  speculation and gives the same output whatever the drafts were.
- Token trees (point drafts whose nodes may branch; row 1 + i scores node i, under a tree
  attention mask) are walked from the last token: the target's token at the current row
  (argmax, or its sample) is accepted when a child node holds it, and the walk moves
  there; otherwise it is emitted. The longest path the target agrees with wins; the emitted
  tokens are the same target samples as for a chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_ref.core.sampler import SampleRow, filtered_probs, sample_one, token_logprobs


@dataclass(frozen=True)
class Chain:
    """One sequence's draft to verify: `draft_token_ids` (k >= 0 tokens), its sampling row,
    and `draft_probs` [k, V], the filtered draft distributions q the tokens were sampled from,
    or None for point drafts (q one-hot at each drafted token). `parents` makes the draft a
    token tree (see `DraftTree`); None is a chain. Trees take point drafts only."""

    draft_token_ids: list[int]
    row: SampleRow
    draft_probs: torch.Tensor | None = None
    parents: list[int | None] | None = None

    def __post_init__(self) -> None:
        if self.parents is not None and self.draft_probs is not None:
            raise ValueError("token trees take point drafts only")


@dataclass(frozen=True)
class Verified:
    """What a chain emits: its accepted drafts, then one token more (the target's correction
    at the first rejection, or the bonus token). `logprobs` as the sampler gives them, one
    entry per emitted token, or None. `path`: the accepted draft nodes, in order (for a chain
    0, 1, ..., num_accepted - 1)."""

    token_ids: list[int]
    num_accepted: int
    logprobs: list[dict[int, float]] | None = None
    path: list[int] | None = None


def verify(
    logits: torch.Tensor, chains: list[Chain], generator: torch.Generator | None = None
) -> list[Verified]:
    """Verify `chains` against logits [sum(k_i + 1), V] (each chain's k_i + 1 rows in order).
    Seeded rows draw from their own generators, unseeded ones from `generator`; draws happen
    chain by chain, position by position, and stop at a chain's first rejection."""
    logits = logits.float()
    offsets = [0]
    for chain in chains:
        offsets.append(offsets[-1] + len(chain.draft_token_ids) + 1)
    greedy = [i for i, c in enumerate(chains) if c.row.params.is_greedy]
    sampled = [i for i, c in enumerate(chains) if not c.row.params.is_greedy]
    argmax: list[int] = []
    if greedy:
        rows = [r for i in greedy for r in range(offsets[i], offsets[i + 1])]
        argmax = logits.index_select(0, _index(rows, logits)).argmax(dim=-1).tolist()
    probs = None
    if sampled:
        rows = [r for i in sampled for r in range(offsets[i], offsets[i + 1])]
        params = [chains[i].row.params for i in sampled for _ in range(offsets[i], offsets[i + 1])]
        probs = filtered_probs(logits.index_select(0, _index(rows, logits)), params)  # [R, V]

    results: list[Verified | None] = [None] * len(chains)
    at = 0
    for i in greedy:
        k = len(chains[i].draft_token_ids)
        rows_argmax = argmax[at : at + k + 1]
        results[i] = _walk(chains[i], rows_argmax.__getitem__)
        at += k + 1
    at = 0
    for i in sampled:
        chain = chains[i]
        k = len(chain.draft_token_ids)
        gen = chain.row.generator if chain.row.generator is not None else generator
        results[i] = _verify_sampled(chain, probs[at : at + k + 1], gen)
        at += k + 1
    out = []
    for i, (chain, result) in enumerate(zip(chains, results, strict=True)):
        assert result is not None
        if chain.row.params.logprobs is not None:
            emitted = result.token_ids
            rows = [offsets[i]] + [offsets[i] + 1 + node for node in result.path or []]
            rows_logits = logits.index_select(0, _index(rows[: len(emitted)], logits))
            lps = token_logprobs(rows_logits, [chain.row] * len(emitted), emitted)
            result = Verified(result.token_ids, result.num_accepted, lps, result.path)  # type: ignore[arg-type]
        out.append(result)
    return out


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution a rejection resamples from: max(0, p - q) normalised [V]. p == q
    (where rejection cannot happen) gives p."""
    residual = (p - q).clamp_(min=0.0)
    total = residual.sum()
    return p if total <= 0 else residual / total


def _walk(chain: Chain, target_token: Callable[[int], int]) -> Verified:
    """Point drafts: from the last token (row 0), take the target's token at the current row
    (`target_token(row)`, called once per emitted token, in order); a child node holding it
    is accepted and its row (1 + node) is next, else the token is emitted and the walk ends."""
    draft = chain.draft_token_ids
    parents = chain.parents
    if parents is None:
        parents = [None, *range(len(draft) - 1)] if draft else []
    children: dict[int | None, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    node: int | None = None
    path: list[int] = []
    while True:
        token = target_token(0 if node is None else node + 1)
        child = next((c for c in children.get(node, ()) if draft[c] == token), None)
        if child is None:
            return Verified([draft[c] for c in path] + [token], len(path), path=path)
        path.append(child)
        node = child


def _verify_sampled(
    chain: Chain, probs: torch.Tensor, generator: torch.Generator | None
) -> Verified:
    """probs [k + 1, V]: the target's filtered distributions for the chain's rows."""
    if chain.draft_probs is None:
        return _walk(chain, lambda row: sample_one(probs[row], generator))
    draft = chain.draft_token_ids
    for j, token in enumerate(draft):
        p = probs[j]
        q = chain.draft_probs[j]
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * float(q[token]) < float(p[token]):  # u < p / q, q(token) > 0 as it was drawn
            continue
        return Verified(
            draft[:j] + [sample_one(residual_probs(p, q), generator)], j, path=[*range(j)]
        )
    return Verified(
        draft + [sample_one(probs[len(draft)], generator)], len(draft), path=[*range(len(draft))]
    )


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=like.device)
