"""reports: report cards from run directories, comparisons and the CI regression gate.

- `reports.build.build_card(run_dir) -> Card`: the card model (`reports.card`), every figure
  from `slo.summarize`; `Card.to_json()` is the versioned JSON card (`reports/card_schema.md`).
- `reports.console`: the rich views; `render_summary(card_or_summary, console, run_dir=None)`
  prints the end-of-run summary of `bench run`.
- `reports.html.render_html(card)` / `render_comparison_html(comparison)`: self-contained HTML.
- `reports.compare.compare_runs(run_dirs, allow_mismatch=False)`: runs side by side.
- `reports.gate.run_gate(baseline, candidate, config=...)`: the regression gate
  (`reports.gate_config`, `reports.gate_report` for Markdown and JUnit XML).
- `reports.cli`: the `bench report` and `bench compare` commands (`reports.cli_export`:
  `bench export`; `reports.cli_errors`: how they end on a user's error).

Only the exception is imported here, so `import reports` stays light.
"""

from reports.errors import ReportError

__all__ = ["ReportError"]
