"""Does the server count prompts as the workload did? `usage.prompt_tokens` against the
workload's `input_tokens`, request by request.

A run whose tokenizer is not the target model's builds prompts of the wrong length and reports
input throughput off by the same factor, without a word. The chat template adds a constant
number of tokens per request (`overhead_tokens`); anything beyond it, and a small tolerance for
special tokens and merges at the template's seams, is a disagreement.
"""

from __future__ import annotations

import numpy as np

# A request agrees when |usage - input - overhead| <= max(ABS_TOLERANCE, REL_TOLERANCE * input).
ABS_TOLERANCE_TOKENS = 4
REL_TOLERANCE = 0.05
# The run disagrees when more than this fraction of the compared requests disagree.
MAX_DISAGREEING_FRACTION = 0.05


def disagreeing(
    input_tokens: np.ndarray, usage_prompt_tokens: np.ndarray, overhead_tokens: float = 0.0
) -> np.ndarray:
    """Boolean per request: the server's count is outside the tolerance around the workload's
    count plus `overhead_tokens`. Rows with either count missing (NaN) are False."""
    inp = np.asarray(input_tokens, dtype=np.float64)
    usage = np.asarray(usage_prompt_tokens, dtype=np.float64)
    both = ~np.isnan(inp) & ~np.isnan(usage)
    tolerance = np.maximum(ABS_TOLERANCE_TOKENS, REL_TOLERANCE * np.nan_to_num(inp))
    off = np.abs(np.nan_to_num(usage) - np.nan_to_num(inp) - overhead_tokens) > tolerance
    return both & off


def prompt_token_check(
    input_tokens: np.ndarray,
    usage_prompt_tokens: np.ndarray,
    *,
    overhead_tokens: float = 0.0,
) -> dict:
    """The cross-check's verdict over the requests that have both counts.

    Returns `{verdict, n_compared, n_disagreeing, ratio, overhead_tokens, sentence}`:
    `verdict` is `agree`, `disagree` or `not_checked` (no request has both counts, e.g. a
    server that sends no usage); `ratio` is sum(usage - overhead) / sum(input) over the compared
    requests (1.0 when the tokenizers agree; None when not checked); `sentence` is the one-line
    warning for a disagreement, else None.
    """
    inp = np.asarray(input_tokens, dtype=np.float64)
    usage = np.asarray(usage_prompt_tokens, dtype=np.float64)
    both = ~np.isnan(inp) & ~np.isnan(usage)
    n = int(np.count_nonzero(both))
    result = {
        "verdict": "not_checked",
        "n_compared": n,
        "n_disagreeing": 0,
        "ratio": None,
        "overhead_tokens": float(overhead_tokens),
        "sentence": None,
    }
    if n == 0:
        return result
    n_bad = int(np.count_nonzero(disagreeing(inp, usage, overhead_tokens)))
    total_input = float(inp[both].sum())
    ratio = float((usage[both] - overhead_tokens).sum() / total_input) if total_input > 0 else None
    result.update(n_disagreeing=n_bad, ratio=ratio)
    if n_bad > MAX_DISAGREEING_FRACTION * n:
        result["verdict"] = "disagree"
        if ratio is not None and ratio > 0:
            counted = f"{ratio:.2f}x the prompt tokens the workload recorded ({n_bad} of {n}"
        elif ratio is not None:  # below the template's own tokens: a ratio would be <= 0
            counted = (
                "fewer prompt tokens than the chat template alone adds "
                f"({overhead_tokens:g} per request; {n_bad} of {n}"
            )
        else:
            counted = f"prompt tokens for empty prompts ({n_bad} of {n}"
        result["sentence"] = (
            f"The server counted {counted} requests disagree): the tokenizer is not the "
            "target model's, so prompt lengths and input tokens/s are off; pass --tokenizer."
        )
    else:
        result["verdict"] = "agree"
    return result
