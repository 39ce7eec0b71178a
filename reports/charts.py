"""Charts for the HTML card: matplotlib figures (Agg backend, no pyplot state) as inline SVG.

Each function takes card data (one or several labelled `Series` pieces) and returns an SVG
string, or None when there is nothing to draw, so the page can say so instead of showing an
empty frame. Output is deterministic: no dates in the metadata, a fixed id salt.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from reports.taxonomy import OUTCOME_KINDS, OutcomeKind  # noqa: E402

# Colour-blind-safe palette (Okabe-Ito) for runs; outcome kinds get fixed colours.
RUN_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
OUTCOME_COLOURS = {
    "rejected": "#E69F00",
    "timeout": "#D55E00",
    "oom": "#CC79A7",
    "cancelled": "#999999",
    "unknown": "#56B4E9",
    "wrong_output": "#F0E442",
    "error": "#000000",
}
FAULT_COLOUR = "#D55E00"
# matplotlib settings every chart is drawn and saved under: text kept as text, a fixed id salt.
CHART_RC = {
    "svg.fonttype": "none",
    "svg.hashsalt": "llm-bench-card",
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
}
METRIC_TITLES = {
    "ttft": "Time to first token",
    "tpot": "Time per output token",
    "itl": "Inter-token latency (per chunk)",
    "e2e": "End-to-end latency",
}


def new_figure(width_in: float = 6.4, height_in: float = 3.0) -> Figure:
    """A figure of `width_in` x `height_in` inches with constrained layout, outside pyplot."""
    return Figure(figsize=(width_in, height_in), layout="constrained")


def figure_svg(fig: Figure) -> str:
    """`fig` as inline SVG (from `<svg` on), saved under `CHART_RC` with no date in it, so the
    same figure gives the same text."""
    buf = io.StringIO()
    with matplotlib.rc_context(CHART_RC):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    text = buf.getvalue()
    # Inline SVG needs no XML prolog or DOCTYPE; keep from the <svg element on.
    return text[text.index("<svg") :]


def _shade_windows(ax, fault_windows: list[dict]) -> None:
    """Shade each fault window, labelled (once per kind) and named on the chart at its start."""
    labelled: set[str] = set()
    for window in fault_windows:
        if window.get("start_s") is None or window.get("end_s") is None:
            continue
        kind = window.get("kind") or "window"
        ax.axvspan(
            window["start_s"],
            window["end_s"],
            color=FAULT_COLOUR,
            alpha=0.12,
            label=None if kind in labelled else f"fault: {kind}",
        )
        ax.annotate(
            kind,
            xy=(window["start_s"], 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, -10),
            textcoords="offset points",
            fontsize=7,
            color="#8a4b2a",
        )
        labelled.add(kind)


def latency_cdf_svg(metric: str, cdfs: dict[str, list]) -> str | None:
    """CDF chart of `metric` (ms) with one line per label: `cdfs` maps label -> CDF points."""
    drawn = {label: pts for label, pts in cdfs.items() if pts}
    if not drawn:
        return None
    with matplotlib.rc_context(CHART_RC):
        fig = new_figure(6.4, 3.4)
        ax = fig.add_subplot()
        for i, (label, points) in enumerate(drawn.items()):
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            ax.step(xs, ys, where="post", color=RUN_COLOURS[i % len(RUN_COLOURS)], label=label)
        ax.set_title(f"{METRIC_TITLES.get(metric, metric)} CDF")
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        if len(drawn) > 1:
            ax.legend(loc="lower right", fontsize=7)
        return figure_svg(fig)


def over_time_svg(metric: str, series_by_label: dict[str, list], fault_windows: list) -> str | None:
    """p50 (solid) and p90 (dashed) of `metric` per time bin, one colour per label."""
    drawn = {label: rows for label, rows in series_by_label.items() if rows}
    if not drawn:
        return None
    with matplotlib.rc_context(CHART_RC):
        fig = new_figure()
        ax = fig.add_subplot()
        _shade_windows(ax, fault_windows)
        for i, (label, rows) in enumerate(drawn.items()):
            colour = RUN_COLOURS[i % len(RUN_COLOURS)]
            ts = [r[0] for r in rows]
            prefix = f"{label} " if len(drawn) > 1 else ""
            ax.plot(ts, [r[1] for r in rows], color=colour, marker=".", label=f"{prefix}p50")
            ax.plot(ts, [r[2] for r in rows], color=colour, ls="--", label=f"{prefix}p90")
        ax.set_title(f"{METRIC_TITLES.get(metric, metric)} over time")
        ax.set_xlabel("send time (s from run start)")
        ax.set_ylabel(f"{metric} (ms)")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
        return figure_svg(fig)


def failures_over_time_svg(
    rows: list[dict], bin_s: float | None, fault_windows: list
) -> str | None:
    """Stacked bars of failed requests per bin by kind, ok requests as a line, faults shaded."""
    if not rows or not bin_s:
        return None
    with matplotlib.rc_context(CHART_RC):
        fig = new_figure()
        ax = fig.add_subplot()
        _shade_windows(ax, fault_windows)
        ts = [r["t_s"] for r in rows]
        bottom = [0] * len(rows)
        for kind in OUTCOME_KINDS:
            if kind == OutcomeKind.OK:
                continue
            counts = [r.get(kind, 0) for r in rows]
            if any(counts):
                ax.bar(
                    ts, counts, width=bin_s, align="edge", bottom=bottom,
                    color=OUTCOME_COLOURS[kind], label=kind,
                )  # fmt: skip
                bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
        ax.plot(
            [t + bin_s / 2 for t in ts], [r.get("ok", 0) for r in rows],
            color="#009E73", marker=".", label="ok",
        )  # fmt: skip
        ax.set_title(f"Outcomes per {bin_s:g} s (by completion time)")
        ax.set_xlabel("time (s from run start)")
        ax.set_ylabel("requests")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
        return figure_svg(fig)


def slice_bars_svg(slices: list, metric_key: str = "ttft_p99_ms") -> str | None:
    """Horizontal bars of `metric_key` per slice (`SliceRow`s), grouped by dimension."""
    rows = [s for s in slices if getattr(s, metric_key) is not None]
    if not rows:
        return None
    with matplotlib.rc_context(CHART_RC):
        fig = new_figure(6.4, max(1.6, 0.28 * len(rows) + 0.8))
        ax = fig.add_subplot()
        labels = [f"{s.dimension}={s.value}" for s in rows]
        dims = sorted({s.dimension for s in rows})
        colours = [RUN_COLOURS[dims.index(s.dimension) % len(RUN_COLOURS)] for s in rows]
        ax.barh(range(len(rows)), [getattr(s, metric_key) for s in rows], color=colours)
        ax.set_yticks(range(len(rows)), labels)
        ax.invert_yaxis()
        ax.set_xlabel(metric_key.replace("_ms", " (ms)").replace("_", " "))
        ax.set_title("Per-slice latency")
        return figure_svg(fig)


def capacity_svg(curves: dict[str, list[dict]]) -> str | None:
    """Goodput (and SLO attainment, right axis) versus offered rate, one colour per label."""
    drawn = {label: rows for label, rows in curves.items() if rows}
    if not drawn:
        return None
    with matplotlib.rc_context(CHART_RC):
        fig = new_figure()
        ax = fig.add_subplot()
        ax2 = ax.twinx()
        for i, (label, rows) in enumerate(drawn.items()):
            colour = RUN_COLOURS[i % len(RUN_COLOURS)]
            rates = [r["rate"] for r in rows]
            prefix = f"{label} " if len(drawn) > 1 else ""
            ax.plot(rates, [r.get("goodput") for r in rows], color=colour, marker="o",
                    label=f"{prefix}goodput")  # fmt: skip
            ax2.plot(rates, [r.get("attainment") for r in rows], color=colour, ls=":",
                     marker="x", label=f"{prefix}attainment")  # fmt: skip
        ax.set_title("Goodput versus offered rate")
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel("goodput (requests/s)")
        ax2.set_ylabel("SLO attainment")
        ax2.set_ylim(0, 1.05)
        ax2.grid(False)
        handles, labels = ax.get_legend_handles_labels()
        handles2, labels2 = ax2.get_legend_handles_labels()
        ax.legend(
            handles + handles2, labels + labels2, loc="upper left", bbox_to_anchor=(1.12, 1.0),
            fontsize=7, frameon=False,
        )  # fmt: skip
        return figure_svg(fig)


def server_metrics_svg(series: dict[str, list]) -> str | None:
    """The target's running and waiting requests (left axis) and KV cache usage (right axis,
    %) over the run, from the summary's `server_metrics.series`."""
    counts = {k: series.get(k) for k in ("running", "waiting") if series.get(k)}
    kv = series.get("kv_cache_usage")
    if not counts and not kv:
        return None
    with matplotlib.rc_context(CHART_RC):
        fig = new_figure()
        ax = fig.add_subplot()
        for i, (name, rows) in enumerate(counts.items()):
            ax.step([r[0] for r in rows], [r[1] for r in rows], where="post",
                    color=RUN_COLOURS[i % len(RUN_COLOURS)], label=f"{name} requests")  # fmt: skip
        ax.set_xlabel("time (s from run start)")
        ax.set_ylabel("requests")
        ax.set_ylim(bottom=0)
        if kv:
            right = ax.twinx()
            right.plot([r[0] for r in kv], [100 * r[1] for r in kv], color="grey", ls="--",
                       label="KV cache usage")  # fmt: skip
            right.set_ylabel("KV cache usage (%)")
            right.set_ylim(0, 100)
            right.legend(loc="upper right", fontsize=7, frameon=False)
        ax.set_title("Server metrics over time")
        if counts:
            ax.legend(loc="upper left", fontsize=7, frameon=False)
        return figure_svg(fig)
