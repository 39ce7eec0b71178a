"""n-gram prompt lookup: draft the tokens that followed the sequence's own suffix earlier on.

Repetition-heavy outputs (a text being repeated, edited, summarised with quotes, code being
refactored) copy long runs from their context; looking the last few tokens up in the context
and proposing what came after them costs microseconds and no model.
"""

from __future__ import annotations

from collections.abc import Sequence

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
