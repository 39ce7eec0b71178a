"""slo: metric definitions, SLO specs and verdicts, goodput, capacity search.

Entry point: `summarize(run_dir, slo_spec=None) -> dict`, the content of `summary.json`.
"""

from slo import metrics
from slo.errors import SLOError
from slo.summary import summarize, summarize_tables

__all__ = ["SLOError", "metrics", "summarize", "summarize_tables"]
