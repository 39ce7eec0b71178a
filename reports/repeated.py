"""The comparative card of repeated runs: several targets, each run N times on the same
workload; per row, each target's n, mean, 95% interval and ratio to the first target."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.table import Table

from reports.build import build_card, read_manifest
from reports.card import CARD_SCHEMA_VERSION, Card, round_floats
from reports.compare import ROW_SPECS, card_value, find_mismatches
from reports.errors import ReportError
from slo.repeats import mean_ci, ratio

# Rows beyond the single-run comparison: the output oracle, when outputs were checked.
ORACLE_ROWS = (
    ("output_exact_rate", "outputs equal to the reference (fraction)", True, 3),
    ("output_agreement_mean", "token agreement with the reference", True, 3),
)


def repeated_value(card: Card, key: str) -> float | None:
    """A row's figure from one run's card (the oracle rows from its `correctness`)."""
    if key == "output_exact_rate":
        return card.correctness.exact_rate if card.correctness is not None else None
    if key == "output_agreement_mean":
        return card.correctness.agreement_mean if card.correctness is not None else None
    return card_value(card, key)


@dataclass(frozen=True)
class TargetStat:
    """One target's figure over its repetitions; `ratio` is its mean over the first target's."""

    target: str
    n: int
    mean: float | None
    ci_low: float | None
    ci_high: float | None
    ratio: float | None


@dataclass(frozen=True)
class RepeatedRow:
    key: str
    label: str
    higher_is_better: bool
    digits: int
    stats: list[TargetStat]


@dataclass(frozen=True)
class RepeatedComparison:
    """`runs[target]` lists that target's run directories in the order they ran."""

    targets: list[str]
    runs: dict[str, list[str]]
    order: list[str]
    rows: list[RepeatedRow]
    notes: list[str] = field(default_factory=list)
    schema_version: int = CARD_SCHEMA_VERSION

    def to_dict(self, *, decimals: int = 4) -> dict:
        """JSON form: `{schema_version, kind: "repeated_comparison", targets, runs, order,
        notes, rows[{key, label, higher_is_better, digits, stats[{target, n, mean, ci_low,
        ci_high, ratio}]}]}`."""
        data = asdict(self)
        head = {"schema_version": data.pop("schema_version"), "kind": "repeated_comparison"}
        return round_floats({**head, **data}, decimals)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"


def compare_repeated(
    runs: dict[str, list[Path | str]], order: list[str] | None = None
) -> RepeatedComparison:
    """Build the comparison of `runs` (target label -> its run directories; the first target
    is the baseline of every ratio). Raises ReportError when the runs drove different
    workloads or SLOs."""
    if not runs or not all(runs.values()):
        raise ReportError("Give at least one run directory for every target.")
    paths = {t: [Path(p) for p in dirs] for t, dirs in runs.items()}
    labelled = [(f"{t}/{p.name}", read_manifest(p)) for t, ps in paths.items() for p in ps]
    mismatches = find_mismatches(labelled) if len(labelled) > 1 else []
    if mismatches:
        raise ReportError(f"Refusing to compare runs that differ: {'; '.join(mismatches)}.")
    cards = {t: [build_card(p) for p in ps] for t, ps in paths.items()}
    targets = list(paths)
    rows = []
    for key, label, higher, digits in (*ROW_SPECS, *ORACLE_ROWS):
        summaries = {t: mean_ci([repeated_value(c, key) for c in cards[t]]) for t in targets}
        if all(s["n"] == 0 for s in summaries.values()):
            continue
        base = summaries[targets[0]]["mean"]
        stats = [
            TargetStat(target=t, **summaries[t], ratio=ratio(summaries[t]["mean"], base))
            for t in targets
        ]
        rows.append(RepeatedRow(key, label, higher, digits, stats))
    notes = sorted({n for cs in cards.values() for c in cs for n in c.notes})
    return RepeatedComparison(
        targets=targets,
        runs={t: [str(p) for p in ps] for t, ps in paths.items()},
        order=list(order or []),
        rows=rows,
        notes=notes,
    )


def _cell(stat: TargetStat, digits: int, first: bool) -> str:
    if stat.mean is None:
        return "—"
    text = f"{stat.mean:.{digits}f}"
    if stat.ci_low is not None:
        text += f" [{stat.ci_low:.{digits}f}, {stat.ci_high:.{digits}f}]"
    if not first and stat.ratio is not None:
        text += f" ({stat.ratio:.2f}x)"
    return f"{text} n={stat.n}"


def repeated_table(comparison: RepeatedComparison) -> Table:
    """The console table: one row per figure, one column per target (mean [95% CI] (ratio to
    the first target) n)."""
    table = Table(title="comparison over repetitions: mean [95% CI] (ratio to first) n")
    table.add_column("figure")
    for target in comparison.targets:
        table.add_column(target, justify="right")
    for row in comparison.rows:
        cells = [_cell(s, row.digits, i == 0) for i, s in enumerate(row.stats)]
        table.add_row(row.label, *cells)
    return table


def repeated_markdown(comparison: RepeatedComparison) -> str:
    """The same table as Markdown (for notes and issues)."""
    head = "| figure | " + " | ".join(comparison.targets) + " |"
    lines = [head, "|---|" + "---:|" * len(comparison.targets)]
    for row in comparison.rows:
        cells = [_cell(s, row.digits, i == 0) for i, s in enumerate(row.stats)]
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>Comparison: {{ c.targets | join(" vs ") }}</title>
<style>body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,th:first-child{text-align:left}
.warning{color:#a15c00}</style></head><body>
<h1>Comparison: {{ c.targets | join(" vs ") }}</h1>
<p>Order of runs: {{ c.order | join(", ") }}. Each cell: mean [95% t-interval] (ratio to {{ c.targets[0] }}), n repetitions.</p>
{% for note in c.notes %}<p class="warning">{{ note }}</p>{% endfor %}
<table><tr><th>figure</th>{% for t in c.targets %}<th>{{ t }}</th>{% endfor %}</tr>
{% for row in c.rows %}<tr><td>{{ row.label }}</td>{% for s in row.stats %}<td>{{ cell(s, row.digits, loop.first) }}</td>{% endfor %}</tr>{% endfor %}
</table>
<h2>Runs</h2><ul>{% for t, dirs in c.runs.items() %}<li>{{ t }}: {{ dirs | join(", ") }}</li>{% endfor %}</ul>
</body></html>
"""


def repeated_html(comparison: RepeatedComparison) -> str:
    """A self-contained HTML page of the comparison (no scripts, no fetches)."""
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(_HTML).render(c=comparison, cell=_cell)
