"""n-gram prompt lookup: draft the tokens that followed the sequence's own suffix earlier on.

Repetition-heavy outputs (a text being repeated, edited, summarised with quotes, code being
refactored) copy long runs from their context; looking the last few tokens up in the context
and proposing what came after them costs microseconds and no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(
    token_ids: Sequence[int], *, min_n: int, max_n: int, num_tokens: int
) -> list[int]:
    """Up to `num_tokens` draft tokens for `token_ids` (prompt and outputs so far).

    For n from `max_n` down to `min_n`: the last n tokens are searched for earlier in
    `token_ids` (the suffix itself excluded); the tokens that followed an occurrence (at most
    `num_tokens`, at least one) are the draft: the most recent occurrence followed by
    `num_tokens` tokens, else the earliest (the one followed by most). No occurrence of any
    length, `num_tokens` < 1 or a sequence too short gives []."""
    total = len(token_ids)
    if num_tokens < 1 or total < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # Windows of `tokens[:-1]` end at most at total - 2: each is followed by a token.
        windows = sliding_window_view(tokens[:-1], n)  # [total - n, n]
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if matches.size:
            # The latest occurrence followed by a full draft, else the earliest (longest tail).
            full = matches[matches + n + num_tokens <= total]
            start = int(full[-1] if full.size else matches[0]) + n
            return tokens[start : start + num_tokens].tolist()
    return []


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens as a tree, in depth-first order (parents before children): node i holds
    `token_ids[i]` and follows node `parents[i]`, or the sequence's last token when None. A
    chain has parents [None, 0, 1, ...]."""

    token_ids: list[int]
    parents: list[int | None]

    @property
    def depths(self) -> list[int]:
        """Per node, its distance from the last token (1 for the first drafted tokens)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent is None else depths[parent] + 1)
        return depths

    def ancestry_mask(self) -> list[list[bool]]:
        """[n + 1, n + 1]: row r (0 the last token, 1 + i node i) may attend to row c when c is
        r itself or one of its ancestors."""
        n = len(self.token_ids)
        mask = [[c == 0 for c in range(n + 1)] for _ in range(n + 1)]
        mask[0][0] = True
        for i, parent in enumerate(self.parents):
            row = mask[i + 1]
            if parent is not None:
                row[:] = mask[parent + 1]
            row[i + 1] = True
        return mask

    def truncated(self, num_nodes: int) -> DraftTree:
        """The first `num_nodes` nodes (still a tree: parents come first)."""
        return DraftTree(self.token_ids[:num_nodes], self.parents[:num_nodes])


def propose_ngram_tree(
    token_ids: Sequence[int], *, min_n: int, max_n: int, num_tokens: int, num_branches: int
) -> DraftTree | None:
    """At most `num_tokens` draft tokens as a tree of up to `num_branches` continuations:
    first the chain `propose_ngram` drafts, then what followed other earlier occurrences of
    the sequence's suffixes (longest suffix first, most recent occurrence first), distinct
    ones only. Nodes are shared where continuations agree, and added depth by depth across
    the branches until the budget is spent, so every branch gets its first tokens before
    any gets its last. None when nothing matches."""
    first = propose_ngram(token_ids, min_n=min_n, max_n=max_n, num_tokens=num_tokens)
    if not first:
        return None
    candidates = [first]
    total = len(token_ids)
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        if len(candidates) >= num_branches:
            break
        windows = sliding_window_view(tokens[:-1], n)
        for match in np.flatnonzero((windows == tokens[-n:]).all(axis=1))[::-1]:
            start = int(match) + n
            candidate = tokens[start : start + num_tokens].tolist()
            if candidate not in candidates:
                candidates.append(candidate)
                if len(candidates) >= num_branches:
                    break
    # Breadth-first insertion into a trie; `paths[b]` is branch b's nodes so far.
    node_tokens: list[int] = []
    node_parents: list[int | None] = []
    children: dict[int | None, list[int]] = {None: []}
    paths: list[list[int]] = [[] for _ in candidates]
    for depth in range(num_tokens):
        for b, candidate in enumerate(candidates):
            if depth >= len(candidate) or len(paths[b]) < depth:
                continue  # ended, or cut off by the budget above this depth
            parent = paths[b][-1] if depth else None
            node = next((c for c in children[parent] if node_tokens[c] == candidate[depth]), None)
            if node is None:
                if len(node_tokens) >= num_tokens:
                    continue
                node = len(node_tokens)
                node_tokens.append(candidate[depth])
                node_parents.append(parent)
                children[parent].append(node)
                children[node] = []
            paths[b].append(node)
    # Renumber depth-first, the first branch first (its nodes keep slots 0, 1, ...).
    order: list[int] = []
    stack = list(reversed(children[None]))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    new_index = {old: new for new, old in enumerate(order)}
    return DraftTree(
        [node_tokens[old] for old in order],
        [None if node_parents[old] is None else new_index[node_parents[old]] for old in order],
    )
