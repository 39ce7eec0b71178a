"""Turning lengths into token-exact prompts, plain and in shared-prefix groups, with the
verify-and-repair policy described in `workloads.prompts` (Mooncake blocks: `workloads.blocks`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workloads.prompts import Prompt, PromptSynthesizer, verify_prompts
from workloads.schema import WorkloadError

FULL_CHECK_TOKENS = 2_000_000
SAMPLE_CHECK = 2_000


@dataclass
class PromptCheck:
    """What verification did: prompts re-encoded, how many needed repair, unrepairable ones."""

    checked: int = 0
    repaired: int = 0
    mismatched: int = 0
    mode: str = "all"
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "checked": self.checked,
            "repaired": self.repaired,
            "mismatched": self.mismatched,
        }


def _indices_to_check(
    prompts: list[Prompt], rng: np.random.Generator, check: PromptCheck
) -> list[int]:
    total = sum(len(p.token_ids) for p in prompts)
    if total <= FULL_CHECK_TOKENS or len(prompts) <= SAMPLE_CHECK:
        check.mode = "all"
        return list(range(len(prompts)))
    check.mode = "sample"
    return sorted(rng.choice(len(prompts), size=SAMPLE_CHECK, replace=False).tolist())


def _verify(
    tokenizer: Any, prompts: list[Prompt], rng: np.random.Generator, check: PromptCheck
) -> list[int]:
    idx = _indices_to_check(prompts, rng, check)
    bad = verify_prompts(tokenizer, prompts, indices=idx)
    check.checked += len(idx)
    if bad and check.mode == "sample":
        check.mode = "all (a sampled prompt failed)"
        rest = sorted(set(range(len(prompts))) - set(idx))
        bad += verify_prompts(tokenizer, prompts, indices=rest)
        check.checked += len(rest)
    return sorted(bad)


def plain_prompts(
    synth: PromptSynthesizer, lengths: np.ndarray, rng: np.random.Generator, check: PromptCheck
) -> list[Prompt]:
    """Prompts of exactly `lengths` tokens, verified; failures are rebuilt on the slow path."""
    prompts = synth.prompts(lengths, rng)
    for i in _verify(synth.tokenizer, prompts, rng, check):
        prompts[i] = synth.retokenised_prompt(int(lengths[i]), rng, lead=True)
        check.repaired += 1
    return prompts


def prefixed_prompts(
    synth: PromptSynthesizer,
    suffix_lengths: np.ndarray,
    groups: np.ndarray,
    prefix_len: int,
    rng: np.random.Generator,
    check: PromptCheck,
) -> list[Prompt]:
    """Prompts `prefix(group) + suffix`: every member of a group starts with the same
    `prefix_len` token ids (and the same text); total length = prefix_len + suffix length."""
    num_groups = int(groups.max()) + 1 if len(groups) else 0
    prefixes = plain_prompts(synth, np.full(num_groups, prefix_len), rng, check)

    def join(i: int, tail: Prompt) -> Prompt:
        head = prefixes[int(groups[i])]
        return Prompt(head.text + tail.text, np.concatenate([head.token_ids, tail.token_ids]))

    tails = synth.prompts(suffix_lengths, rng, lead=False)
    prompts = [join(i, tail) for i, tail in enumerate(tails)]
    for i in _verify(synth.tokenizer, prompts, rng, check):
        for _ in range(64):
            candidate = join(i, synth.continuation(int(suffix_lengths[i]), rng))
            if verify_prompts(synth.tokenizer, [candidate]) == []:
                prompts[i] = candidate
                check.repaired += 1
                break
        else:
            raise WorkloadError(
                f"Could not build a prompt of {prefix_len} shared + {int(suffix_lengths[i])} tokens "
                f"that re-tokenises exactly with {getattr(synth.tokenizer, 'name', 'the tokenizer')}."
            )
    return prompts
