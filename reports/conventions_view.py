"""The conventions side by side: TTFT, TPOT, ITL and output throughput under this harness's
definitions and vLLM's, GuideLLM's, AIPerf's and MLPerf's, one row per tool and metric with
its one-line definition and its source (`slo.conventions` computes them). The same rows feed
the console table (`bench report --conventions`) and the card's HTML section."""

from __future__ import annotations

from rich.table import Table

TOOL_TITLES = {"harness": "llm-bench", "vllm": "vLLM", "guidellm": "GuideLLM",
               "aiperf": "AIPerf", "mlperf": "MLPerf"}  # fmt: skip


def convention_rows(conventions: dict | None) -> list[dict]:
    """[{tool, metric, unit, mean, p50, p99, n, definition, source, percentile_method}] in
    tool order; empty for no block or a non-streamed run (whose block says why)."""
    rows: list[dict] = []
    for tool, block in (conventions or {}).items():
        if not isinstance(block, dict) or "metrics" not in block:
            continue
        title = TOOL_TITLES.get(tool, tool)
        common = {"tool": title, "source": block.get("source"),
                  "percentile_method": block.get("percentile_method")}  # fmt: skip
        for name, m in block["metrics"].items():
            rows.append({**common, "metric": name, "unit": "ms", "mean": m.get("mean"),
                         "p50": m.get("p50"), "p99": m.get("p99"), "n": m.get("n"),
                         "definition": m.get("definition")})  # fmt: skip
        for name, rate in (block.get("throughput") or {}).items():
            rows.append({**common, "metric": name, "unit": "tokens/s", "mean": rate.get("value"),
                         "p50": None, "p99": None, "n": None,
                         "definition": rate.get("definition")})  # fmt: skip
    return rows


def _fmt(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def conventions_renderable(conventions: dict | None):
    """A rich Table of `convention_rows`, or a one-line note when there is nothing to show."""
    rows = convention_rows(conventions)
    if not rows:
        reason = (conventions or {}).get("undefined") or "no conventions in the summary"
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


def conventions_sources(conventions: dict | None) -> list[tuple[str, str, str]]:
    """(tool, source, percentile method) per tool, for the table's footnote."""
    out = []
    for tool, block in (conventions or {}).items():
        if isinstance(block, dict) and "source" in block:
            out.append((TOOL_TITLES.get(tool, tool), block["source"], block["percentile_method"]))
    return out
