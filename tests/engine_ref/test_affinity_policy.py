"""The `affinity` policy through `LLMEngine.step`: waiting requests whose prompt starts with
cached blocks go first, and one overtaken by `affinity_max_bypass` later arrivals goes next
regardless. Blocks of 4 tokens, one request at a time; a first request leaves an 8-token
prefix S (2 full blocks) in the prefix cache. Then x1, s1, x2, s2, s3 arrive in that order:
the s requests are S plus 3 tokens of their own (2 cached blocks each; the last token is never
served from the cache), the x requests share nothing (0)."""

from __future__ import annotations

import pytest
from policy_util import PARAMS, finish_order, make, prompt

from engine_ref import EngineConfig, EngineConfigError

SHARED = prompt(8, 200)


def _run(engine) -> list[str]:
    engine.add_request("seed", SHARED + prompt(4, 300), PARAMS)
    assert finish_order(engine) == ["seed"]
    for name in ("x1", "s1", "x2", "s2", "s3"):
        number = int(name[1])
        own = prompt(3, 20 * number) if name[0] == "s" else prompt(11, 100 + 20 * number)
        engine.add_request(name, SHARED + own if name[0] == "s" else own, PARAMS)
    return finish_order(engine)


@pytest.mark.parametrize(
    ("policy", "max_bypass", "order"),
    [
        # fcfs: arrival order (the negative control: no affinity).
        ("fcfs", 8, "x1 s1 x2 s2 s3"),
        # Bound 0: every waiting request is due at once: the oldest first, as fcfs.
        ("affinity", 0, "x1 s1 x2 s2 s3"),
        # Bound 1: s1 overtakes x1 (x1 at 1: due) -> x1; s2 overtakes x2 (1) -> x2; s3.
        ("affinity", 1, "s1 x1 s2 x2 s3"),
        # Bound 2: s1 (x1 at 1), s2 (x1 at 2, x2 at 1) -> x1 due; s3 (x2 at 2) -> x2.
        ("affinity", 2, "s1 s2 x1 s3 x2"),
        # Bound 3: s1, s2, s3 (x1 at 3, x2 at 2) -> x1 due, then x2.
        ("affinity", 3, "s1 s2 s3 x1 x2"),
        # A bound never reached: all cached prefixes first, then arrival order.
        ("affinity", 100, "s1 s2 s3 x1 x2"),
    ],
)
def test_cached_prefixes_go_first_within_the_bypass_bound(tiny_model, policy, max_bypass, order):
    engine = make(tiny_model, policy, block_size=4, affinity_max_bypass=max_bypass)
    assert _run(engine) == order.split()
    assert engine.stats().num_blocks_used == 0


def test_the_lookup_allocates_nothing(tiny_model):
    """Ranking the waiting requests reads the cache: blocks, refcounts and the prefix-cache
    counters are as before it (the counters move only when a request is admitted)."""
    engine = make(tiny_model, "affinity", block_size=4, max_num_seqs=1)
    engine.add_request("seed", SHARED + prompt(4, 300), PARAMS)
    finish_order(engine)
    for name in ("a", "b"):
        engine.add_request(name, SHARED + prompt(3, ord(name)), PARAMS)
    bm = engine.block_manager
    before = (list(bm.ref_counts), list(bm.free_blocks), engine.stats().prefix_cache_query_tokens)
    waiting = list(engine.scheduler.waiting())
    assert [len(bm.cached_prefix(seq)) for seq in waiting] == [2, 2]
    after = (list(bm.ref_counts), list(bm.free_blocks), engine.stats().prefix_cache_query_tokens)
    assert after == before


@pytest.mark.parametrize("value", [-1, 2.0, None])
def test_a_bad_bypass_option_is_one_sentence(value):
    with pytest.raises(EngineConfigError, match="^affinity_max_bypass must be"):
        EngineConfig(affinity_max_bypass=value)
