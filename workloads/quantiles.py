"""Empirical length quantiles bundled with the package (derived from public traces), and the
derivation that produced them, so tests can re-derive them from the real files.

`data/azure_2023_quantiles.json` holds, for the Azure LLM inference trace 2023 (Patel et al.,
"Splitwise", ISCA 2024; `AzureLLMInferenceTrace_conv.csv` and `_code.csv`, CC-BY), the
quantiles of ContextTokens (input) and GeneratedTokens (output) at `QUANTILE_PROBS`, computed
with numpy's default (linear) quantile method over every row of each file. Sampling them by
inverse CDF with linear interpolation (`lengths.Empirical`) reproduces each file's marginal
length distribution; input and output are sampled independently (they are nearly uncorrelated
in both files: Pearson r = -0.11 for conv, 0.001 for code).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from workloads.loaders import load_azure
from workloads.schema import WorkloadError

QUANTILE_PROBS: tuple[float, ...] = (
    (0.0, 0.001, 0.005) + tuple(round(i / 100, 2) for i in range(1, 100)) + (0.995, 0.999, 1.0)
)
BUNDLED_FILE = "azure_2023_quantiles.json"


def derive_quantiles(
    values: np.ndarray, probs: tuple[float, ...] = QUANTILE_PROBS
) -> list[list[float]]:
    """[[p, quantile], ...] of `values` (numpy linear method), values rounded to 0.01 tokens."""
    q = np.quantile(np.asarray(values, dtype=np.float64), probs)
    return [[float(p), round(float(v), 2)] for p, v in zip(probs, q, strict=True)]


def derive_azure(path: Path) -> dict[str, Any]:
    """Input and output quantiles of one Azure trace file."""
    rec = load_azure(path)
    return {
        "rows": len(rec),
        "input": derive_quantiles(rec.input_tokens),
        "output": derive_quantiles(rec.output_tokens),
    }


def bundled_quantiles() -> dict[str, Any]:
    """The bundled table: {"azure-2023-conv": {"input": [...], "output": [...]}, ...}."""
    text = resources.files("workloads.data").joinpath(BUNDLED_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def bundled_points(key: str) -> list[list[float]]:
    """Quantile points for a key such as "azure-2023-conv/input"."""
    table = bundled_quantiles()
    name, _, which = key.partition("/")
    if name not in table or which not in ("input", "output"):
        known = [f"{k}/{w}" for k in table if k != "derivation" for w in ("input", "output")]
        raise WorkloadError(
            f"Unknown bundled length distribution {key!r}; known: {', '.join(known)}."
        )
    return table[name][which]
