"""Sampler: greedy, temperature, top-k, top-p against hand-computed distributions; seeded rows
reproduce whatever else is in the batch; banned tokens; logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine_ref.core.engine_config import SamplingParams
from engine_ref.core.sampler import SampleRow, inverse_cdf, sample, sample_one

DRAWS = 20000


def frequencies(logits_row: list[float], params: SamplingParams) -> list[float]:
    logits = torch.tensor([logits_row] * DRAWS)
    out = sample(logits, [SampleRow(params)] * DRAWS, torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=len(logits_row))
    return (counts.float() / DRAWS).tolist()


def assert_freq(got: list[float], expected: list[float]) -> None:
    for g, e in zip(got, expected, strict=True):
        # 5 standard errors of a binomial proportion (0 when e is 0 or 1).
        assert abs(g - e) <= 5 * math.sqrt(e * (1 - e) / DRAWS) + 1e-9, (got, expected)


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 4.9], [0.0, 0.0, 7.0]])
    out = sample(logits, [SampleRow(SamplingParams(temperature=0))] * 3)
    assert out.token_ids == [1, 0, 2]


def test_temperature_scales_the_distribution():
    row = [0.0, math.log(2.0)]
    assert_freq(frequencies(row, SamplingParams(temperature=1.0)), [1 / 3, 2 / 3])
    s2 = math.sqrt(2.0)  # T = 2: p proportional to [1, 2 ** 0.5]
    assert_freq(frequencies(row, SamplingParams(temperature=2.0)), [1 / (1 + s2), s2 / (1 + s2)])


def test_top_k_keeps_the_k_most_likely():
    row = [math.log(p) for p in (0.1, 0.4, 0.2, 0.3)]
    # top-2: tokens 1 and 3, renormalised 0.4 / 0.7 and 0.3 / 0.7
    assert_freq(frequencies(row, SamplingParams(top_k=2)), [0, 4 / 7, 0, 3 / 7])


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    row = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    # Sorted mass before each token: 0, 0.5, 0.8, 0.95; top_p 0.8 keeps the first two.
    assert_freq(frequencies(row, SamplingParams(top_p=0.8)), [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    # top_p 0.81 also keeps the third (mass before it is 0.8 < 0.81).
    assert_freq(
        frequencies(row, SamplingParams(top_p=0.81)), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]
    )


def test_top_k_and_top_p_combine_per_row():
    row = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    got = frequencies(row, SamplingParams(top_k=3, top_p=0.9))
    # top-3 renormalised: 0.5/0.95, 0.3/0.95, 0.15/0.95; mass before the third 0.842 < 0.9.
    assert_freq(got, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])


def test_mixed_batch_greedy_and_random_rows():
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
    rows = [SampleRow(SamplingParams(temperature=0)), SampleRow(SamplingParams(top_k=1)),
            SampleRow(SamplingParams(temperature=0))]  # fmt: skip
    out = sample(logits, rows, torch.Generator().manual_seed(1))
    assert out.token_ids[0] == 1 and out.token_ids[2] == 0


def test_seeded_row_reproduces_regardless_of_batch():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=gen)
    params = SamplingParams(temperature=1.0)

    def seeded_token(batch_rows: int) -> int:
        rows = [SampleRow(params, torch.Generator().manual_seed(42))]
        rows += [SampleRow(params)] * (batch_rows - 1)
        out = sample(logits[:batch_rows].clone(), rows, torch.Generator().manual_seed(batch_rows))
        return out.token_ids[0]

    tokens = {seeded_token(n) for n in (1, 3, 6)}
    assert len(tokens) == 1
    draws = {
        sample(logits[:1].clone(), [SampleRow(params, torch.Generator().manual_seed(s))]).token_ids[
            0
        ]
        for s in range(30)
    }
    assert len(draws) > 1  # different seeds do differ


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[0.0, 10.0, 0.0]] * 2)
    rows = [SampleRow(SamplingParams(temperature=0), banned_token_ids=(1,)),
            SampleRow(SamplingParams(temperature=1.0), banned_token_ids=(1, 2))]  # fmt: skip
    assert sample(logits, rows).token_ids == [0, 0]


@pytest.mark.parametrize("k", [0, 2])
def test_logprobs_of_sampled_and_top_tokens(k):
    probs = [0.1, 0.6, 0.3]
    logits = torch.tensor([[math.log(p) + 7.0 for p in probs]])  # shift-invariant
    out = sample(logits, [SampleRow(SamplingParams(temperature=0, logprobs=k))])
    entry = out.logprobs[0]
    expected = {1: math.log(0.6)} if k == 0 else {1: math.log(0.6), 2: math.log(0.3)}
    assert entry.keys() == expected.keys()
    for token, value in expected.items():
        assert abs(entry[token] - value) < 1e-5


@pytest.mark.parametrize("temperature", [1e20, 1e300])
def test_huge_temperature_is_uniform_over_allowed_tokens(temperature):
    # -inf / inf would be NaN: a temperature past float32's range must not become inf.
    row = [0.0, 5.0, -3.0, 1.0]
    logits = torch.tensor([row] * DRAWS)
    rows = [SampleRow(SamplingParams(temperature=temperature), banned_token_ids=(1,))] * DRAWS
    out = sample(logits, rows, torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4)
    assert_freq((counts.float() / DRAWS).tolist(), [1 / 3, 0, 1 / 3, 1 / 3])


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 5e-324])
def test_temperature_below_threshold_is_greedy(temperature):
    logits = torch.tensor([[0.1, 3.0, 2.9999], [5.0, -1.0, 4.9]])
    rows = [SampleRow(SamplingParams(temperature=temperature, seed=1))] * 2
    assert sample(logits, rows, torch.Generator().manual_seed(0)).token_ids == [1, 0]


def test_top_p_rounding_to_zero_keeps_the_top_token():
    assert_freq(frequencies([0.0, 2.0, 1.0], SamplingParams(top_p=5e-324)), [0, 1, 0])


@pytest.mark.parametrize("top_k", [3, 4, 2**63, 2**64])
def test_top_k_at_or_beyond_vocab_keeps_every_token(top_k):
    row = [0.0, math.log(2.0), math.log(3.0)]
    assert_freq(frequencies(row, SamplingParams(top_k=top_k)), [1 / 6, 2 / 6, 3 / 6])


def test_logprobs_beyond_vocab_return_every_token():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = sample(logits, [SampleRow(SamplingParams(temperature=0, logprobs=20))])
    assert sorted(out.logprobs[0]) == [0, 1, 2]
    assert abs(sum(math.exp(v) for v in out.logprobs[0].values()) - 1) < 1e-5


# -- inverse_cdf: the draw itself, at the ends of [0, 1) and of the row -------------------------
U_BELOW_ONE = 1.0 - 2.0**-53  # the largest float64 torch.rand can return


@pytest.mark.parametrize(
    ("probs", "uniform", "expected"),
    [
        # u = 0 takes the last token with mass, u just below 1 the first; zero-mass tokens at
        # either end of the row (filtered, banned) are never chosen.
        ([0.0, 0.25, 0.75, 0.0], 0.0, 2),
        ([0.0, 0.25, 0.75, 0.0], U_BELOW_ONE, 1),
        ([0.0, 0.25, 0.75, 0.0], 0.75 - 1e-9, 1),  # target just above 0.25: token 2
        ([0.0, 0.25, 0.75, 0.0], 0.75 + 1e-9, 1),  # just below: token 1
        ([1.0], 0.0, 0),
        ([1.0], U_BELOW_ONE, 0),
        ([0.0, 0.0, 1.0], U_BELOW_ONE, 2),
        ([1.0, 0.0, 0.0], 0.0, 0),
        # Unnormalised rows (float32 sums drift from 1) scale the target by their total.
        ([0.5, 0.5, 0.5, 0.5], 0.5 - 1e-9, 1),
    ],
)
def test_inverse_cdf_boundaries(probs, uniform, expected):
    got = inverse_cdf(torch.tensor([probs]), torch.tensor([uniform], dtype=torch.float64))
    assert got.tolist() == [expected]


def test_inverse_cdf_matches_numpy_on_the_models_vocabulary():
    """49,152 tokens (SmolLM2's vocabulary), a peaked softmax: the frequencies of the top tokens
    and of the tail as a whole against an independent float64 sampler (numpy's choice)."""
    import numpy as np

    vocab, draws = 49152, 4000  # 20,000 draws cost CI 8-11 s (a 20,000 x 49,152 cumsum)
    gen = torch.Generator().manual_seed(11)
    probs = (torch.randn(vocab, generator=gen) * 3).softmax(-1)
    got = inverse_cdf(
        probs.expand(draws, vocab), torch.rand(draws, generator=gen, dtype=torch.float64)
    )
    ref = np.random.default_rng(11).choice(
        vocab, size=draws, p=(p64 := probs.double().numpy()) / p64.sum()
    )
    top = torch.topk(probs, 5).indices.tolist()
    for token in top:
        a = float((got == token).float().mean())
        b = float((torch.from_numpy(ref) == token).float().mean())
        e = float(probs[token])
        # Both within 5 standard errors of the true probability.
        for f in (a, b):
            assert abs(f - e) <= 5 * math.sqrt(e * (1 - e) / draws), (token, a, b, e)
    assert (probs[got] > 0).all()


def test_sample_one_is_the_seeded_rows_draw():
    """What speculative verification draws for a position equals what `sample` draws for the
    same seeded row in a batch."""
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0)
    for seed in range(20):
        rows = [
            SampleRow(params),
            SampleRow(params, torch.Generator().manual_seed(seed)),
            SampleRow(params),
        ]
        batch = sample(logits.clone(), rows).token_ids[1]
        alone = sample_one(logits[1].softmax(-1), torch.Generator().manual_seed(seed))
        assert batch == alone


def test_sampler_benchmark_runs_both_draws(capsys):
    from benchmark_scripts import load_benchmark

    bench = load_benchmark("sampler")
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 200)
    gen = torch.Generator().manual_seed(3)
    for draw in (bench.race, bench.cdf):  # both sample the same distribution
        tokens = draw(probs, gen)
        assert set(tokens.tolist()) == {1, 2}
    assert bench.main(["--rows", "1,3", "--vocab", "64", "--repeats", "1", "--calls", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU: ") and len(lines) == 4
    assert [line.split()[0] for line in lines[2:]] == ["1", "3"]
