"""Beam search (vLLM's older request shape: `use_beam_search`, `best_of` the width, `n` returned,
`length_penalty`): what a request asks, each beam's candidates from its logits row, one step's
ranking, and the answer. The output processor keeps the beams as sequences of the request:
a beam chosen twice forks (its blocks shared, copied on write when they diverge), a beam not
chosen is freed.

One step, once every live beam of the request has its logits row: every continuation is ranked
by cumulative log-probability (ties: the earlier beam, then the lower token id). Walking down
the ranking, a continuation that ends a beam (an end-of-sequence id unless `ignore_eos`, or a
stop token) becomes a finished hypothesis when it ranks among the first `width`; any other
becomes a beam, until `width` beams. A beam at `max_tokens` or the context length finishes
("length"). The search ends when `width` hypotheses have finished or no beam is left (beams
still running are then dropped); the answer is the `n` best hypotheses by cumulative
log-probability / output tokens ** `length_penalty`. Temperature, top-k, top-p and seed do not
apply; a beam-search request takes no stop strings, logprobs, min_tokens or grammar, and never
speculates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine_ref.core.detokenizer import IncrementalDetokenizer
from engine_ref.core.outputs import CompletionOutput, RequestOutput

# engine_ref.core.sequence's Sequence and Request (it imports this module, through
# engine_config, so the types are named here, not imported).
Sequence = Any
Request = Any


@dataclass(frozen=True)
class BeamHypothesis:
    """A finished beam: its output token ids, cumulative log-probability and finish reason."""

    token_ids: tuple[int, ...]
    score: float
    finish_reason: str


def check_params(params: Any) -> None:
    """Raises ValueError (one sentence) for `SamplingParams` (types already checked) this
    engine cannot run: `best_of` above 1 without beam search, beam search with fewer beams
    than `n` or with what it does not take."""
    if not params.use_beam_search:
        if params.best_of is not None and params.best_of > 1:
            raise ValueError("best_of above 1 needs use_beam_search.")
        return
    if params.best_of is not None and params.best_of < params.n:
        raise ValueError(f"best_of ({params.best_of}) must be at least n ({params.n}).")
    used = {"stop": bool(params.stop), "logprobs": params.logprobs is not None,
            "min_tokens": params.min_tokens > 0, "guided": params.guided is not None}  # fmt: skip
    unsupported = [name for name, on in used.items() if on]
    if unsupported:
        raise ValueError(f"beam search does not take {', '.join(unsupported)}.")


def candidates(
    logits: torch.Tensor, beams: list[tuple[Sequence, int]], device: torch.device
) -> list[tuple[Sequence, list[tuple[int, float]]]]:
    """Per beam (its logits row) its 2 x width most likely next tokens and their
    log-probabilities (float32): a request's best `width` continuations over all its beams are
    among them, whatever ends a beam."""
    index = torch.tensor([r for _, r in beams], dtype=torch.long, device=device)
    log_probs = logits.index_select(0, index).float().log_softmax(dim=-1)
    out = []
    for (seq, _), row in zip(beams, log_probs, strict=True):
        values, tokens = row.topk(min(2 * seq.request.params.beam_width, row.shape[0]))
        out.append((seq, list(zip(tokens.tolist(), values.tolist(), strict=True))))
    return out


def rank(
    live: list[Sequence], width: int, ends: Callable[[int], bool]
) -> tuple[list[tuple[Sequence, int, float]], list[BeamHypothesis]]:
    """One step's choice over `live` (every beam with its candidates): the continuations
    that become beams (beam, token, score) and the hypotheses that finish (module doc)."""
    ranked = sorted(
        (
            (seq.beam_score + lp, order, token)
            for order, seq in enumerate(live)
            for token, lp in seq.beam_candidates or ()
        ),
        key=lambda c: (-c[0], c[1], c[2]),
    )
    chosen: list[tuple[Sequence, int, float]] = []
    finished: list[BeamHypothesis] = []
    for position, (score, order, token) in enumerate(ranked):
        if len(chosen) == width:
            break
        seq = live[order]
        if ends(token):
            if position < width:
                finished.append(BeamHypothesis((*seq.output_token_ids, token), score, "stop"))
            continue
        chosen.append((seq, token, score))
    return chosen, finished


def answer(request: Request, decode: Callable[[list[int]], str]) -> RequestOutput:
    """The finished request's output: its `n` best hypotheses, whole (index = rank)."""
    params = request.params
    best = sorted(
        request.beam_finished,
        key=lambda h: -h.score / len(h.token_ids) ** params.length_penalty,
    )[: params.n]
    completions = []
    for index, hypothesis in enumerate(best):
        detok = IncrementalDetokenizer(decode, request.prompt_token_ids)
        detok.add(list(hypothesis.token_ids))
        text = detok.text + detok.flush()
        completions.append(
            CompletionOutput(
                index,
                list(hypothesis.token_ids),
                text,
                hypothesis.finish_reason,
                len(hypothesis.token_ids),
            )  # fmt: skip
        )
    prompt_len = len(request.prompt_token_ids)
    return RequestOutput(
        request.request_id, completions, True, prompt_len, request.num_cached_tokens,
        kv_evicted_tokens=request.kv_evicted_tokens,
    )  # fmt: skip
