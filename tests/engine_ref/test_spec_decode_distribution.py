"""Losslessness of the verifier: on a toy bigram model with a 6-token vocabulary, 100,000
samples of the first three tokens drawn through speculative verification (k = 2 drafts per
step) match the target's exact joint distribution by a chi-square test at significance 0.001,
for temperature 1 and for top-p 0.9, with point drafts (n-gram style, q one-hot) and with
drafts sampled from a draft distribution q. A deliberately broken rule (resampling a rejected
position from p instead of the residual max(0, p - q)) fails the same test.

The expected distribution is computed here with numpy, independently of the sampler's
temperature and top-p code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine_ref.core.engine_config import SamplingParams
from engine_ref.core.sampler import SampleRow, filtered_probs
from engine_ref.core.spec_decode import verification
from engine_ref.core.spec_decode.verification import Chain, verify

VOCAB = 6
NUM_SAMPLES = 100_000
LENGTH = 3  # tokens per sample: x1, x2, x3 after context token 0
K = 2
ALPHA = 1e-3
BATCH = 10_000

_gen = torch.Generator().manual_seed(1234)
TARGET = torch.randn(VOCAB, VOCAB, generator=_gen) * 1.5  # logits of next | previous token
DRAFT = torch.randn(VOCAB, VOCAB, generator=_gen) * 1.5


def reference_probs(logits_row: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Temperature then nucleus filtering: keep the most likely tokens until their mass
    reaches top_p (a token whose preceding mass is already >= top_p is dropped)."""
    z = logits_row / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order[before < top_p]] = True
    keep[order[0]] = True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def expected_joint(temperature: float, top_p: float) -> np.ndarray:
    table = np.stack([reference_probs(TARGET[i].double().numpy(), temperature, top_p)
                      for i in range(VOCAB)])  # fmt: skip
    joint = np.zeros((VOCAB,) * LENGTH)
    for x1 in range(VOCAB):
        for x2 in range(VOCAB):
            for x3 in range(VOCAB):
                joint[x1, x2, x3] = table[0, x1] * table[x1, x2] * table[x2, x3]
    return joint.ravel()


def speculative_samples(params: SamplingParams, drafts: str, num_samples: int) -> np.ndarray:
    """[NUM_SAMPLES, LENGTH] tokens, each sample decoded from context token 0 by rounds of
    propose-k-then-verify, as the engine's steps do."""
    generator = torch.Generator().manual_seed(7)
    draft_gen = torch.Generator().manual_seed(8)
    row = SampleRow(params)
    out = []
    for _ in range(num_samples // BATCH):
        seqs = [[0] for _ in range(BATCH)]
        active = list(range(BATCH))
        while active:
            last = torch.tensor([seqs[i][-1] for i in active])
            if drafts == "point":  # a guess, right some of the time
                d1 = (last * 2 + 1) % VOCAB
                d2 = (d1 * 2 + 1) % VOCAB
                q = None
            else:  # sampled from the draft model's filtered distribution
                q1 = filtered_probs(DRAFT[last], [params] * len(active))
                d1 = torch.multinomial(q1, 1, generator=draft_gen).squeeze(1)
                q2 = filtered_probs(DRAFT[d1], [params] * len(active))
                d2 = torch.multinomial(q2, 1, generator=draft_gen).squeeze(1)
                q = torch.stack([q1, q2], dim=1)  # [B, K, V]
            logits = TARGET[torch.stack([last, d1, d2], dim=1)].reshape(-1, VOCAB)  # [B*3, V]
            chains = [
                Chain([int(d1[j]), int(d2[j])], row, None if q is None else q[j])
                for j in range(len(active))
            ]
            for i, result in zip(active, verify(logits, chains, generator), strict=True):
                seqs[i] += result.token_ids
            active = [i for i in active if len(seqs[i]) < LENGTH + 1]
        out += [s[1 : LENGTH + 1] for s in seqs]
    return np.array(out)


def chi_square_pvalue(samples: np.ndarray, expected: np.ndarray) -> float:
    cells = np.ravel_multi_index(samples.T, (VOCAB,) * LENGTH)
    counts = np.bincount(cells, minlength=VOCAB**LENGTH)
    assert counts[expected == 0].sum() == 0, "a token outside the nucleus was emitted"
    support = expected > 0
    f_exp = expected[support] * len(samples)
    return float(chisquare(counts[support], f_exp * counts.sum() / f_exp.sum()).pvalue)


T1 = SamplingParams(temperature=1.0)
TOP_P = SamplingParams(temperature=1.0, top_p=0.9)
# The 100,000-sample runs take 10-20 s each on a 2-core machine: the soak tier (`--soak`). The
# default suite runs one case of each test on 20,000 samples.
slow = [pytest.mark.slow, pytest.mark.soak]
CASES = [
    pytest.param(T1, "point", NUM_SAMPLES, id="temperature-1-point-100k", marks=slow),
    pytest.param(T1, "sampled", NUM_SAMPLES, id="temperature-1-sampled-100k", marks=slow),
    pytest.param(TOP_P, "point", NUM_SAMPLES, id="top-p-0.9-point-100k", marks=slow),
    pytest.param(TOP_P, "sampled", NUM_SAMPLES, id="top-p-0.9-sampled-100k", marks=slow),
    pytest.param(T1, "point", 20_000, id="temperature-1-point-20k"),
    pytest.param(TOP_P, "sampled", 20_000, id="top-p-0.9-sampled-20k"),
]
BROKEN_CASES = [
    pytest.param(T1, NUM_SAMPLES, id="temperature-1-100k", marks=slow),
    pytest.param(TOP_P, NUM_SAMPLES, id="top-p-0.9-100k", marks=slow),
    pytest.param(TOP_P, 20_000, id="top-p-0.9-20k"),
]


@pytest.mark.parametrize(("params", "drafts", "num_samples"), CASES)
def test_speculative_samples_follow_the_target_distribution(params, drafts, num_samples):
    samples = speculative_samples(params, drafts, num_samples)
    assert samples.shape == (num_samples, LENGTH)
    assert chi_square_pvalue(samples, expected_joint(params.temperature, params.top_p)) > ALPHA


@pytest.mark.parametrize(("params", "num_samples"), BROKEN_CASES)
def test_a_broken_rule_fails_the_same_test(params, num_samples, monkeypatch):
    """Resampling a rejected position from p, not max(0, p - q), over-weights the tokens the
    draft favours; the test must see it."""
    monkeypatch.setattr(verification, "residual_probs", lambda p, q: p)
    samples = speculative_samples(params, "sampled", num_samples)
    assert chi_square_pvalue(samples, expected_joint(params.temperature, params.top_p)) < ALPHA


def test_greedy_verification_by_hand():
    """Drafts [3, 1] against argmaxes [3, 2, 5]: 3 accepted, 1 rejected, 2 emitted."""
    logits = torch.full((3, VOCAB), -5.0)
    logits[0, 3] = logits[1, 2] = logits[2, 5] = 5.0
    row = SampleRow(SamplingParams(temperature=0))
    (result,) = verify(logits, [Chain([3, 1], row)])
    assert result.token_ids == [3, 2] and result.num_accepted == 1
    (result,) = verify(logits, [Chain([3, 2], row)])
    assert result.token_ids == [3, 2, 5] and result.num_accepted == 2  # bonus token
    (result,) = verify(logits[:1], [Chain([], row)])
    assert result.token_ids == [3] and result.num_accepted == 0
