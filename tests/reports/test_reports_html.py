"""The HTML cards: self-contained, and in headless Chromium without console errors or
network requests, with every chart drawn and a non-blank page."""

from __future__ import annotations

import io
import re
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from chromium_probe import CHROMIUM, probe_page
from rundir_builder import SyntheticRun, write_run

from reports.build import build_card
from reports.compare import compare_runs
from reports.html import render_comparison_html, render_html

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="/usr/bin/chromium is absent (Debian: apt-get install -y chromium); "
    "the HTML card is not opened in a browser",
)
# Four CDFs, TTFT and TPOT over time, outcomes over time, per-slice bars, goodput vs rate.
RUN_CHARTS = 9


def _assert_self_contained(html: str) -> None:
    for tag in ("<script", "<link", "<img", "<iframe", "@import"):
        assert tag not in html
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#)""", html)
    assert set(re.findall(r"url\(([^)]*)\)", html)) <= {
        u for u in re.findall(r"url\(([^)]*)\)", html) if u.startswith("#")
    }


def _blank_fraction(png: bytes) -> tuple[float, int]:
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    non_white = np.any(pixels < 245, axis=2).mean()
    colours = np.unique(pixels.reshape(-1, 3)[::97], axis=0).shape[0]
    return float(non_white), int(colours)


def test_run_card_html_is_self_contained(golden_run):
    card = build_card(golden_run)
    html = render_html(card)
    _assert_self_contained(html)
    assert html.count("<svg") == RUN_CHARTS
    assert "@media print" in html and card.run_id in html
    assert "Content-Security-Policy" in html
    # The stylesheet goes in verbatim: HTML-escaping quotes inside <style> would break it.
    assert (resources.files("reports") / "card.css").read_text() in html


def test_chart_without_data_says_so(tmp_path):
    run = write_run(
        tmp_path / "r", SyntheticRun(n_requests=10, failures={"timeout": 10}, write_summary=False)
    )
    html = render_html(build_card(run))
    assert "Time to first token CDF: no data to draw." in html
    _assert_self_contained(html)


@pytest.mark.slow
@needs_chromium
def test_run_card_in_headless_chromium(golden_run, tmp_path):
    path = tmp_path / "card.html"
    path.write_text(render_html(build_card(golden_run)))
    report = probe_page(path)
    assert report.console == [] and report.exceptions == []
    assert [e for e in report.log_entries if e["level"] in ("error", "warning")] == []
    assert report.requests == [path.resolve().as_uri()]  # the page itself, nothing else
    assert len(report.charts) == RUN_CHARTS
    for chart in report.charts:
        assert chart["has_svg"] and chart["drawn_paths"] >= 3, chart
        assert chart["width"] > 300 and chart["height"] > 150, chart
    non_white, colours = _blank_fraction(report.screenshot_png)
    assert non_white > 0.05 and colours > 20
    assert report.pdf.startswith(b"%PDF") and len(report.pdf) > 20_000
    (Path(tmp_path) / "card.png").write_bytes(report.screenshot_png)


@pytest.mark.slow
@needs_chromium
def test_comparison_card_in_headless_chromium(tmp_path):
    runs = [
        write_run(
            tmp_path / name, SyntheticRun(n_requests=60, seed=i, latency_scale=scale, engine=name)
        )
        for i, (name, scale) in enumerate((("engine-a", 1.0), ("engine-b", 1.3), ("engine-c", 0.8)))
    ]
    path = tmp_path / "compare.html"
    path.write_text(render_comparison_html(compare_runs(runs)))
    _assert_self_contained(path.read_text())
    best_marker = "getComputedStyle(document.querySelector('td.best'), '::after').content"
    report = probe_page(path, expressions={"best_marker": best_marker})
    assert report.console == [] and report.exceptions == []
    assert report.requests == [path.resolve().as_uri()]
    assert report.values["best_marker"] == '" ★"'
    assert len(report.charts) == 6  # four overlaid CDFs, TTFT and TPOT over time
    assert all(chart["drawn_paths"] >= 3 for chart in report.charts)
    assert _blank_fraction(report.screenshot_png)[0] > 0.05
