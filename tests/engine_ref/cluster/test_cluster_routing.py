"""The routing policies as tables: which worker each request goes to, worked out by hand."""

from __future__ import annotations

import pytest

from engine_ref.cluster.routing import (
    POLICIES,
    LeastLoaded,
    PrefixAffinity,
    RoundRobin,
    Route,
    make_policy,
    prompt_block_keys,
    root_key,
)
from engine_ref.serving.interface import prefix_block_hash

IDLE3 = {0: 0, 1: 0, 2: 0}


def _choices(policy, loads: list[dict[int, int]], keys=()) -> list[int]:
    return [policy.choose(keys, inflight).worker for inflight in loads]


def test_round_robin_cycles_in_index_order():
    assert _choices(RoundRobin(), [IDLE3] * 7) == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_skips_a_dead_worker_and_takes_it_back():
    policy = RoundRobin()
    both = {0: 5, 2: 0}  # worker 1 is down; load does not matter to round robin
    assert _choices(policy, [IDLE3, both, both, both, IDLE3]) == [0, 2, 0, 2, 0]


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([{0: 3, 1: 1, 2: 2}], [1]),  # the fewest in flight
        ([{0: 2, 1: 2, 2: 1}, {0: 2, 1: 2, 2: 5}], [2, 0]),  # then 0: first tied after 2
        ([{0: 1, 1: 0, 2: 0}] * 3, [1, 2, 1]),  # ties rotate after the last choice
        ([IDLE3] * 4, [0, 1, 2, 0]),  # an idle cluster still spreads
        ([{1: 4, 2: 4}], [1]),  # worker 0 down
    ],
)
def test_least_loaded(loads, expected):
    assert _choices(LeastLoaded(), loads) == expected


BS = 4  # block size of these tables


@pytest.mark.parametrize(
    ("n_tokens", "n_keys"),
    [(1, 0), (3, 0), (4, 0), (5, 1), (8, 1), (9, 2)],
)
def test_only_blocks_the_cache_could_serve_get_keys(n_tokens, n_keys):
    """The engine never serves a prompt's last token from its cache: a prompt of exactly one
    block (4 tokens) has no cacheable block, one block + 1 token has one."""
    assert len(prompt_block_keys(list(range(n_tokens)), BS)) == n_keys


def test_block_keys_chain_the_engines_hash_from_the_cache_salt():
    tokens = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    first = prefix_block_hash(root_key(None), (7, 8, 9, 10))
    second = prefix_block_hash(first, (11, 12, 13, 14))
    assert prompt_block_keys(tokens, BS) == (first, second)
    assert prompt_block_keys(tokens, BS, "tenant-a") != (first, second)
    assert prompt_block_keys(tokens[:5] + [99, 99, 99, 99], BS)[0] == first


def _affinity(**kw) -> PrefixAffinity:
    return PrefixAffinity(**kw)


SHARED = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks


def test_prompts_with_the_same_leading_blocks_go_to_the_same_worker():
    policy = _affinity()
    first = policy.choose(prompt_block_keys(SHARED + [50, 51, 52], BS), IDLE3).worker
    # Different third blocks and tails: the two shared blocks decide.
    for tail in ([60, 61, 62, 63, 64], [70], [80, 81, 82, 83, 84, 85, 86, 87, 88]):
        keys = prompt_block_keys(SHARED + tail, BS)
        assert policy.choose(keys, IDLE3) == Route(first)


def test_prompts_sharing_only_the_first_block_follow_it():
    policy = _affinity()
    first = policy.choose(prompt_block_keys(SHARED + [9], BS), IDLE3).worker
    keys = prompt_block_keys([1, 2, 3, 4, 40, 41, 42, 43, 44], BS)
    assert policy.choose(keys, IDLE3).worker == first


def test_new_prefixes_spread_by_consistent_hashing_over_the_live_workers():
    """Rendezvous hashing: each new prefix goes to the live worker scoring highest; with that
    worker down it goes to its second choice, and nothing else moves."""
    prompts = [[i] * 9 for i in range(40)]
    keys = [prompt_block_keys(p, BS) for p in prompts]
    chosen = [_affinity().choose(k, IDLE3).worker for k in keys]
    assert set(chosen) == {0, 1, 2}
    without_1 = {0: 0, 2: 0}
    moved = [_affinity().choose(k, without_1).worker for k in keys]
    assert all(m == c for m, c in zip(moved, chosen, strict=True) if c != 1)
    assert all(m in (0, 2) for m, c in zip(moved, chosen, strict=True) if c == 1)


@pytest.mark.parametrize("n_tokens", [3, 4])
def test_a_prompt_without_a_cacheable_block_goes_least_loaded(n_tokens):
    """Shorter than a block, or exactly one block: no key, so the least-loaded worker (1),
    and not a fallback."""
    keys = prompt_block_keys(list(range(n_tokens)), BS)
    assert _affinity().choose(keys, {0: 2, 1: 0, 2: 1}) == Route(1, fallback=False)


def test_one_block_and_one_token_has_affinity():
    policy = _affinity()
    keys = prompt_block_keys([1, 2, 3, 4, 5], BS)
    owner = policy.choose(keys, IDLE3).worker
    busy_elsewhere = {w: (0 if w == owner else 1) for w in IDLE3}
    assert policy.choose(prompt_block_keys([1, 2, 3, 4, 6], BS), busy_elsewhere).worker == owner


@pytest.mark.parametrize(
    ("owner_load", "fallback"),
    [(3, False), (4, False), (5, True)],  # limit = 1.5 x mean + 1 = 0.75 x load + 1
)
def test_the_load_bound_just_below_at_and_above(owner_load, fallback):
    """Two workers, bound 0.5, the other worker idle: the limit is (1 + 0.5) x (load / 2) + 1,
    which a load of 4 meets exactly (4 <= 4: kept), 3 is below, 5 above (5 > 4.75: the
    least-loaded worker instead)."""
    policy = _affinity(load_bound=0.5)
    keys = prompt_block_keys(SHARED + [9], BS)
    owner = policy.choose(keys, {0: 0, 1: 0}).worker
    other = 1 - owner
    loads = {owner: owner_load, other: 0}
    assert policy.limit(loads) == 0.75 * owner_load + 1
    expected = Route(other, fallback=True) if fallback else Route(owner)
    assert policy.choose(keys, loads) == expected


def test_a_fallback_moves_the_prefix_to_the_worker_that_served_it():
    policy = _affinity(load_bound=0.0)
    keys = prompt_block_keys(SHARED + [9], BS)
    owner = policy.choose(keys, {0: 0, 1: 0}).worker
    other = 1 - owner
    # limit = (1 + 0) x mean + 1: 2 at loads (2, 0) keeps the owner, 2.5 at (3, 0) does not
    assert policy.choose(keys, {owner: 2, other: 0}) == Route(owner)
    assert policy.choose(keys, {owner: 3, other: 0}) == Route(other, fallback=True)
    assert policy.choose(keys, {owner: 0, other: 0}) == Route(other)


def test_the_table_forgets_the_least_recently_used_keys():
    policy = _affinity(max_keys=2)
    a, b = prompt_block_keys([1] * 5, BS), prompt_block_keys([2] * 5, BS)
    policy.choose(a, {0: 0, 1: 0})
    policy.choose(b, {0: 0, 1: 0})
    policy.choose(prompt_block_keys([3] * 5, BS), {0: 0, 1: 0})  # evicts a's key
    assert a[0] not in policy._owner and b[0] in policy._owner
    assert len(policy._owner) == 2


def test_policies_by_name():
    assert [make_policy(name).name for name in POLICIES] == list(POLICIES)
    with pytest.raises(ValueError, match="Unknown router policy 'random'; known: round-robin"):
        make_policy("random")
