"""The gate result as Markdown (for a CI job summary), JUnit XML and JSON."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import asdict

from reports.card import round_floats
from reports.gate import GateResult, MetricResult

VERDICT_MARKS = {
    "pass": "✅ pass",
    "regressed": "❌ regressed",
    "improved": "🚀 improved",
    "inconclusive": "⚠️ inconclusive",
}


def _num(value: float | None, digits: int = 2) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:,.{digits}f}"


def _ratio_text(r: MetricResult) -> str:
    e = r.estimate
    if not math.isfinite(e.ratio):
        return "—"
    return f"{e.ratio:.3f} [{_num(e.ci_low, 3)}, {_num(e.ci_high, 3)}]"


def to_markdown(result: GateResult) -> str:
    """A Markdown section: overall verdict, one table row per metric, then notes."""
    lines = [
        f"## Regression gate: {VERDICT_MARKS.get(result.verdict, result.verdict)}",
        "",
        f"Baseline: {', '.join(f'`{p}`' for p in result.baseline)}  ",
        f"Candidate: {', '.join(f'`{p}`' for p in result.candidate)}  ",
        f"SLO: {result.slo_name or 'none'}",
        "",
        "| metric | baseline | candidate | ratio [95% CI] | Mann-Whitney p | threshold | verdict | why |",
        "|---|---:|---:|---|---:|---:|---|---|",
    ]
    for r in result.results:
        e = r.estimate
        floor = f" / {r.noise_floor:g} {r.unit}" if r.noise_floor else ""
        lines.append(
            f"| {r.label} ({r.unit}) | {_num(e.baseline)} | {_num(e.candidate)} | {_ratio_text(r)} "
            f"| {_num(r.mann_whitney_p, 4)} | {r.relative_threshold:.0%}{floor} "
            f"| {VERDICT_MARKS[r.verdict]} | {r.reason} |"
        )
    if result.notes:
        lines += ["", *[f"- {note}" for note in result.notes]]
    return "\n".join(lines) + "\n"


def to_junit_xml(result: GateResult) -> str:
    """JUnit XML: one test case per metric; regressed is a failure, inconclusive a skip."""
    failures = sum(r.verdict == "regressed" for r in result.results)
    skipped = sum(r.verdict == "inconclusive" for r in result.results)
    suite = ET.Element(
        "testsuite",
        name="bench-regression-gate",
        tests=str(len(result.results)),
        failures=str(failures),
        skipped=str(skipped),
        errors="0",
    )
    for r in result.results:
        case = ET.SubElement(suite, "testcase", classname="bench.gate", name=r.metric)
        detail = (
            f"{r.label}: baseline {_num(r.estimate.baseline)} {r.unit}, candidate "
            f"{_num(r.estimate.candidate)} {r.unit}, ratio {_ratio_text(r)}; {r.reason}"
        )
        if r.verdict == "regressed":
            ET.SubElement(case, "failure", message=f"regressed: {r.reason}").text = detail
        elif r.verdict == "inconclusive":
            ET.SubElement(case, "skipped", message=f"inconclusive: {r.reason}").text = detail
        else:
            ET.SubElement(case, "system-out").text = f"{r.verdict}: {detail}"
    suites = ET.Element("testsuites", name="bench compare")
    suites.append(suite)
    ET.indent(suites)
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    )


def to_dict(result: GateResult) -> dict:
    """JSON form of the gate result (floats rounded to 6 places, NaN as None)."""
    data = asdict(result)
    data["exit_code"] = result.exit_code
    return round_floats(data, 6)
