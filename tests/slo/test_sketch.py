"""Pooled chunk gaps within a memory budget (`slo.sketch`, `slo.chunk_digest`): exact up to the
budget's gap count, a sketch beyond whose percentiles stay within the stated relative error
of numpy's exact ones on skewed data, and a row-batch pass whose gaps cross batch boundaries
as the in-memory order's do."""

from __future__ import annotations

import numpy as np
import pytest

from slo import chunk_digest, metrics
from slo.chunk_digest import TOKEN, digest_chunks, read_digest
from slo.runrecord import RunManifest, RunWriter, open_run
from slo.sketch import BYTES_PER_EXACT_GAP, RELATIVE_ERROR, GapPool, exact_gap_limit

QS = (0, 1, 10, 25, 50, 75, 90, 95, 99, 99.9, 100)
RNG = np.random.default_rng(7)
SKEWED = {
    "lognormal": RNG.lognormal(1.0, 1.5, 20_000),
    # two modes (a decode step and a preempted one), far apart
    "bimodal": np.concatenate((RNG.normal(8.0, 0.5, 15_000), RNG.normal(250.0, 20.0, 5_000))),
    # a Pareto tail, with a fifth of the gaps 0 (chunks that came in one read)
    "long-tail": np.concatenate((RNG.pareto(1.2, 16_000) * 3.0, np.zeros(4_000))),
}


def _pool(values: np.ndarray, limit: int | None, per_request: int = 100) -> GapPool:
    """`values` as the gaps of requests of `per_request` gaps each, in one pool."""
    n = -(-values.size // per_request)
    group = np.arange(values.size) // per_request
    pool = GapPool(limit, thresholds=(20.0,))
    pool.add(n, group, values)
    return pool.finish(n)


def _within(estimate: float, exact: float) -> bool:
    return abs(estimate - exact) <= RELATIVE_ERROR * abs(exact) * (1 + 1e-9)


@pytest.mark.parametrize("name", sorted(SKEWED))
def test_sketch_percentiles_are_within_the_stated_error_of_numpys(name):
    values = np.abs(SKEWED[name])
    pooled = _pool(values, limit=0).select(np.arange(200))
    assert (pooled.method, pooled.relative_error) == ("sketch", RELATIVE_ERROR)
    for q in QS:
        exact = float(np.percentile(values, q))
        assert _within(pooled.percentile(q), exact), (q, pooled.percentile(q), exact)
    mean, _, largest = pooled.summary(metrics.PERCENTILES)
    assert pooled.n == values.size and largest == values.max()  # exact either way
    assert mean == pytest.approx(values.mean(), rel=1e-12)
    assert pooled.count_over(20.0) == int((values > 20.0).sum())  # a threshold it counted


def test_a_subset_of_requests_merges_their_sketches():
    values = np.abs(SKEWED["bimodal"])
    pool = _pool(values, limit=0)
    chosen = np.arange(0, 200, 3)  # every third request of 100 gaps
    exact = np.concatenate([values[c * 100 : (c + 1) * 100] for c in chosen])
    pooled = pool.select(chosen)
    assert pooled.n == exact.size
    for q in QS:
        assert _within(pooled.percentile(q), float(np.percentile(exact, q))), q


def test_the_sketch_interval_is_within_the_error_of_the_exact_one():
    values = np.abs(SKEWED["lognormal"])
    sketch, exact = (
        _pool(values, limit=0).select(np.arange(200)),
        _pool(values, None).select(np.arange(200)),
    )
    for q in (50, 99):  # the same seed draws the same ranks: each end within the bound
        low, high = sketch.interval(q, rng=np.random.default_rng(1), confidence=0.95)
        ex_low, ex_high = exact.interval(q, rng=np.random.default_rng(1), confidence=0.95)
        assert _within(low, ex_low) and _within(high, ex_high)


def _write_run(run, requests: dict[str, np.ndarray]) -> None:
    """A run directory whose chunks are one token each at the given times (ns), a request's
    chunks written together as the recorder does."""
    run.mkdir()
    writer = RunWriter(run, RunManifest(t0_ns=0))
    for rid, times in requests.items():
        writer.append_chunks([(rid, int(t), 1, 3) for t in times])
    writer.close(complete=True, reason=None)


@pytest.mark.parametrize(("gaps", "method"), [(59, "exact"), (60, "exact"), (61, "sketch")])
def test_gaps_are_exact_up_to_the_budgets_gap_count_and_a_sketch_above(
    gaps, method, tmp_path, monkeypatch
):
    limit = 60  # the budget below holds 60 gaps exactly
    budget = limit * BYTES_PER_EXACT_GAP + BYTES_PER_EXACT_GAP - 1
    assert exact_gap_limit(budget) == limit
    monkeypatch.setattr(chunk_digest, "BATCH_ROWS", 7)  # requests cross row batches
    times = np.cumsum(np.random.default_rng(gaps).lognormal(15.0, 1.0, gaps + 3)).astype(np.int64)
    split = [0, 20, 21, gaps + 3]  # 19 gaps, none (one chunk), the rest
    run = tmp_path / "run"
    _write_run(run, {f"r{k}": times[split[k] : split[k + 1]] for k in range(3)})
    with monkeypatch.context() as m:  # the writer's layout never needs the in-memory order
        m.setattr(metrics.ChunkOrder, "read", classmethod(lambda *_: pytest.fail("in memory")))
        digest = read_digest(run, budget_bytes=budget)
    pool = digest.pools[TOKEN]
    assert (pool.method, int(pool.count.sum())) == (method, gaps)
    pooled = digest.pooled(TOKEN, ["r0", "r1", "r2"])
    exact = np.concatenate([np.diff(times[split[k] : split[k + 1]]) / 1e6 for k in range(3)])
    for q in QS:
        assert _within(pooled.percentile(q), float(np.percentile(exact, q))), q
    # per request, exact whatever the pool: the in-memory order's figures
    whole = digest_chunks(open_run(run).chunks)
    assert np.array_equal(pool.count, whole.pools[TOKEN].count)
    assert np.allclose(pool.total, whole.pools[TOKEN].total, rtol=1e-12)
    assert np.array_equal(pool.high, whole.pools[TOKEN].high, equal_nan=True)
    if method == "exact":  # across row batches, the same gaps as the whole table
        assert np.array_equal(pooled.values, whole.pooled(TOKEN, ["r0", "r1", "r2"]).values)


def test_a_table_not_grouped_by_request_is_ordered_in_memory(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    writer = RunWriter(run, RunManifest(t0_ns=0))
    writer.append_chunks([("a", 1_000_000, 1, 1), ("b", 1_000_000, 1, 1)])
    writer.append_chunks([("a", 4_000_000, 1, 1), ("b", 3_000_000, 1, 1)])  # a and b again
    writer.close(complete=True, reason=None)
    digest = read_digest(run, budget_bytes=None)
    assert digest.pooled(TOKEN, ["a", "b"]).values.tolist() == [3.0, 2.0]


def test_tokens_per_chunk_from_the_counts_are_the_distribution_of_the_values():
    values = np.array([1, 1, 1, 2, 2, 5, 1, 3, 1, 1, 4])
    assert metrics.counts_distribution(np.bincount(values)) == metrics.distribution(values)
    assert metrics.counts_distribution(np.zeros(3, np.int64)) == metrics.distribution([])
