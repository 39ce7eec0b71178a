"""The card's sentence on pooled figures taken from a sketch (`slo.sketch`).

A run whose chunk gaps are over its memory budget has its pooled figures (ITL, the other
tools' pooled gaps, an ITL objective) from a quantile sketch; the card names each such figure
and the bound on its percentiles' relative error, so a sketched p99 is never read as exact.
Exact figures need no sentence: exact is what every other figure on the card is.
"""

from __future__ import annotations

from slo.runrecord import RunSummary
from slo.sketch import SKETCH


def sketch_notes(summary: RunSummary) -> list[str]:
    """One sentence naming the pooled figures that come from a sketch (none when all exact)."""
    sketched: list[tuple[str, float]] = []
    itl = summary.latency_ms.itl
    if itl is not None and itl.quantiles == SKETCH:
        sketched.append(("ITL", itl.relative_error))
    conventions = summary.conventions
    for tool, block in ((conventions.tools if conventions else None) or {}).items():
        for name, metric in (block.metrics or {}).items():
            if metric.quantiles == SKETCH:
                sketched.append((f"{tool} {name}", metric.relative_error))
    for objective in (summary.slo.objectives if summary.slo else None) or []:
        if objective.quantiles == SKETCH:
            sketched.append((f"objective {objective.name}", objective.relative_error))
    if not sketched:
        return []
    bound = max(error or 0.0 for _, error in sketched)
    names = ", ".join(name for name, _ in sketched)
    return [
        f"Pooled chunk-gap percentiles from a quantile sketch, each within {bound:.0%} of the "
        f"exact value (the run's gaps were over its memory budget): {names}; their mean, max "
        "and counts are exact."
    ]
