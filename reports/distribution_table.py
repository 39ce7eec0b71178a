"""Rows of a card table of per-request distributions: one row per figure some request
reported (label, n, p50, p90, p99, max), shared by the sections that tabulate them."""

from __future__ import annotations

from collections.abc import Iterable

from slo.runrecord import Distribution

DISTRIBUTION_COLUMNS = ("figure", "n", "p50", "p90", "p99", "max")


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value:,.1f}" if unit == "ms" else f"{value:,.0f}"


def distribution_rows(
    figures: Iterable[tuple[str, Distribution | None, str]],
) -> list[tuple[str, ...]]:
    """(label, distribution, unit) -> one row per figure with n > 0; "ms" values keep one
    decimal, other units none."""
    rows = []
    for label, dist, unit in figures:
        dist = dist or Distribution.empty()
        if not dist.n:
            continue
        stats = (dist.p50, dist.p90, dist.p99, dist.max)
        rows.append((label, f"{dist.n}", *(_fmt(v, unit) for v in stats)))
    return rows
