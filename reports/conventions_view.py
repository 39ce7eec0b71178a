"""The conventions side by side: TTFT, TPOT, ITL and output throughput under this harness's
definitions and vLLM's, GuideLLM's, AIPerf's and MLPerf's, one row per tool and metric with
its one-line definition and its source (`slo.conventions` computes them). The same rows feed
the console table (`bench report --conventions`) and the card's HTML section."""

from __future__ import annotations

from rich.table import Table

from slo.runrecord import Conventions

TOOL_TITLES = {"harness": "llm-bench", "vllm": "vLLM", "guidellm": "GuideLLM",
               "aiperf": "AIPerf", "mlperf": "MLPerf"}  # fmt: skip


def _tools(conventions: Conventions | None) -> dict:
    return conventions.tools if conventions is not None else {}


def convention_rows(conventions: Conventions | None) -> list[dict]:
    """[{tool, metric, unit, mean, p50, p99, n, definition, source, percentile_method}] in
    tool order; empty for no block or a non-streamed run (whose block says why)."""
    rows: list[dict] = []
    for tool, block in _tools(conventions).items():
        if block.metrics is None:
            continue
        title = TOOL_TITLES.get(tool, tool)
        common = {"tool": title, "source": block.source,
                  "percentile_method": block.percentile_method}  # fmt: skip
        for name, m in block.metrics.items():
            rows.append({**common, "metric": name, "unit": "ms", "mean": m.mean, "p50": m.p50,
                         "p99": m.p99, "n": m.n, "definition": m.definition})  # fmt: skip
        for name, rate in (block.throughput or {}).items():
            rows.append({**common, "metric": name, "unit": "tokens/s", "mean": rate.value,
                         "p50": None, "p99": None, "n": None,
                         "definition": rate.definition})  # fmt: skip
    return rows


def _fmt(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def conventions_renderable(conventions: Conventions | None):
    """A rich Table of `convention_rows`, or a one-line note when there is nothing to show."""
    rows = convention_rows(conventions)
    if not rows:
        why = conventions.undefined if conventions is not None else None
        reason = why or "no conventions in the summary"
        return f"Conventions: {reason}."
    table = Table(title="The same run under each tool's definitions (ok requests)",
                  title_justify="left")  # fmt: skip
    for name, justify in (("tool", "left"), ("metric", "left"), ("unit", "left"),
                          ("mean", "right"), ("p50", "right"), ("p99", "right"), ("n", "right"),
                          ("definition", "left")):  # fmt: skip
        table.add_column(name, justify=justify)
    last_tool = None
    for row in rows:
        tool = row["tool"] if row["tool"] != last_tool else ""
        last_tool = row["tool"]
        table.add_row(tool, row["metric"], row["unit"], _fmt(row["mean"]), _fmt(row["p50"]),
                      _fmt(row["p99"]), "" if row["n"] is None else str(row["n"]),
                      row["definition"] or "")  # fmt: skip
    return table


def conventions_sources(conventions: Conventions | None) -> list[tuple[str, str, str]]:
    """(tool, source, percentile method) per tool, for the table's footnote."""
    out = []
    for tool, block in _tools(conventions).items():
        if block.source is not None:
            out.append((TOOL_TITLES.get(tool, tool), block.source, block.percentile_method))
    return out
