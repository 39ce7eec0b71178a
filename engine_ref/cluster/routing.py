"""Routing policies: which worker serves the next request. Pure (no I/O, no clock): a policy
sees the request's prompt block keys and the router's own in-flight count per live worker, and
answers a `Route`; the router does the rest.

- `round-robin`: the live workers in index order, one request each, wrapping around.
- `least-loaded`: the live worker with the fewest requests in flight at the router; ties go
  to the first tied worker after the one chosen last (so an idle cluster still spreads).
- `prefix-affinity`: requests whose prompts begin with the same token blocks go to the same
  worker, whose prefix cache then holds them. The prompt is tokenized as the worker would and
  cut into the engine's blocks; each block's key chains its parent's with the engine's own
  hash (`prompt_block_keys`). Only the blocks the engine could serve from its cache count: it
  never serves a prompt's last token from the cache, so a prompt of n tokens has
  (n - 1) // block_size of them (a prompt of exactly one block has none).
  The policy remembers which worker it sent each block key to (a bounded LRU table, the
  router's view of the workers' caches) and chooses the worker that was sent the longest
  leading run of this prompt's blocks. A prompt none of whose blocks was seen goes by
  rendezvous (highest-random-weight) hashing of the key of its whole leading run over the
  live workers: consistent hashing, so a worker that dies moves only its own prompts.
  Load bound: when the chosen worker has more than (1 + load_bound) x the mean in-flight
  count (+1, so an idle cluster never trips it) requests in flight, the request goes to the
  least-loaded worker instead and counts as a fallback. A prompt with no full block (or a body
  the router could not parse: the worker will answer its 4xx) goes to the least-loaded worker
  and is not a fallback. Whichever worker serves the request is then recorded as holding its
  blocks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine_ref.serving.interface import prefix_block_hash

POLICIES = ("round-robin", "least-loaded", "prefix-affinity")
DEFAULT_LOAD_BOUND = 0.5
# Block keys the prefix-affinity table remembers (about 100 bytes each).
DEFAULT_AFFINITY_KEYS = 1 << 16


@dataclass(frozen=True)
class Route:
    """The worker chosen; `fallback`: prefix-affinity's choice was over its load bound."""

    worker: int
    fallback: bool = False


class Policy(Protocol):
    name: str
    needs_block_keys: bool  # whether the router must tokenize prompts for it

    def choose(self, block_keys: Sequence[int], inflight: Mapping[int, int]) -> Route:
        """`inflight`: the live workers (index -> requests in flight), never empty."""
        ...


def root_key(cache_salt: str | None) -> int:
    """The key a prompt's first block chains from. Requests with different cache salts never
    share cached blocks in the engine, so they do not share keys here either."""
    digest = hashlib.sha256(repr(("router", cache_salt)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def prompt_block_keys(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> tuple[int, ...]:
    """The chained key of each leading full block the engine could serve from its prefix
    cache: (len(token_ids) - 1) // block_size of them (the last token is always computed)."""
    keys = []
    parent = root_key(cache_salt)
    for i in range((len(token_ids) - 1) // block_size):
        parent = prefix_block_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        keys.append(parent)
    return tuple(keys)


def _next_after(candidates: Sequence[int], last: int | None) -> int:
    """The first of `candidates` (sorted) after `last`, wrapping around."""
    if last is not None:
        for worker in candidates:
            if worker > last:
                return worker
    return candidates[0]


class RoundRobin:
    name = "round-robin"
    needs_block_keys = False

    def __init__(self) -> None:
        self._last: int | None = None

    def choose(self, block_keys: Sequence[int], inflight: Mapping[int, int]) -> Route:
        self._last = _next_after(sorted(inflight), self._last)
        return Route(self._last)


class LeastLoaded:
    name = "least-loaded"
    needs_block_keys = False

    def __init__(self) -> None:
        self._last: int | None = None

    def choose(self, block_keys: Sequence[int], inflight: Mapping[int, int]) -> Route:
        fewest = min(inflight.values())
        tied = sorted(w for w, n in inflight.items() if n == fewest)
        self._last = _next_after(tied, self._last)
        return Route(self._last)


class PrefixAffinity:
    name = "prefix-affinity"
    needs_block_keys = True

    def __init__(
        self, *, load_bound: float = DEFAULT_LOAD_BOUND, max_keys: int = DEFAULT_AFFINITY_KEYS
    ) -> None:
        if load_bound < 0 or max_keys < 1:
            raise ValueError("load_bound must be >= 0 and max_keys >= 1.")
        self.load_bound = load_bound
        self.max_keys = max_keys
        self._owner: OrderedDict[int, int] = OrderedDict()  # block key -> worker, LRU first
        self._least_loaded = LeastLoaded()

    def choose(self, block_keys: Sequence[int], inflight: Mapping[int, int]) -> Route:
        if not block_keys:
            return self._least_loaded.choose(block_keys, inflight)
        worker = self._holder(block_keys, inflight)
        if worker is None:
            worker = max(sorted(inflight), key=lambda w: prefix_block_hash(block_keys[-1], (w,)))
        route = Route(worker)
        if inflight[worker] > self.limit(inflight):
            route = Route(self._least_loaded.choose(block_keys, inflight).worker, fallback=True)
        self._remember(block_keys, route.worker)
        return route

    def limit(self, inflight: Mapping[int, int]) -> float:
        """The most requests a worker may have in flight and still be chosen for affinity."""
        mean = sum(inflight.values()) / len(inflight)
        return (1 + self.load_bound) * mean + 1

    def _holder(self, block_keys: Sequence[int], inflight: Mapping[int, int]) -> int | None:
        """The live worker sent the longest leading run of `block_keys`, if any."""
        for key in reversed(block_keys):
            worker = self._owner.get(key)
            if worker is not None and worker in inflight:
                return worker
        return None

    def _remember(self, block_keys: Sequence[int], worker: int) -> None:
        for key in block_keys:
            self._owner[key] = worker
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)


def make_policy(name: str, *, load_bound: float = DEFAULT_LOAD_BOUND) -> Policy:
    """The policy called `name`; ValueError naming the known ones otherwise."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-affinity":
        return PrefixAffinity(load_bound=load_bound)
    raise ValueError(f"Unknown router policy {name!r}; known: {', '.join(POLICIES)}.")
