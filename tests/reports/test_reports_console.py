"""The terminal views, against golden strings (plain text, fixed width, no colour).

Regenerate after an intended change (and review the diff):

    UPDATE_GOLDEN=1 python -m pytest -q tests/reports/test_reports_console.py
"""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path

import pytest
from rich.console import Console

import slo
from reports.build import build_card
from reports.console import faults_table, render_summary
from reports.html import render_html
from slo.runrecord import FaultWindow

GOLDEN_DIR = Path(__file__).parent / "golden"


def _render(obj) -> str:
    out = io.StringIO()
    render_summary(obj, Console(file=out, width=110, color_system=None, force_terminal=False))
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"


def _check(name: str, text: str) -> None:
    path = GOLDEN_DIR / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.is_file(), "no golden file: run with UPDATE_GOLDEN=1 once and review it"
    assert text == path.read_text()


def test_card_console_view_matches_golden(golden_run):
    _check("console_card.txt", _render(build_card(golden_run)))


def test_summary_console_view_matches_golden(golden_run):
    _check("console_summary.txt", _render(slo.summarize(golden_run)))


@pytest.mark.parametrize("source", ["card", "summary"])
def test_console_shows_verdicts_and_every_outcome(golden_run, source):
    obj = build_card(golden_run) if source == "card" else slo.summarize(golden_run)
    text = _render(obj)
    assert "INCONCLUSIVE" in text and "ttft_ms p99 <= 200 ms" in text
    assert "goodput (requests/s)" in text
    for word in ("timeout", "rejected", "cancelled"):
        assert word in text
    if source == "card":
        assert "wrong output" in text and "oom" in text


def test_summary_with_run_dir_shows_the_full_card(golden_run, tmp_path):
    # What `bench run` calls: the summary it has, plus the run directory.
    summary = slo.summarize(golden_run)
    out = io.StringIO()
    console = Console(file=out, width=110, color_system=None, force_terminal=False)
    render_summary(summary, console, run_dir=golden_run)
    text = "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"
    assert text == (GOLDEN_DIR / "console_card.txt").read_text()
    fallback = _render(summary)
    out = io.StringIO()
    console = Console(file=out, width=110, color_system=None, force_terminal=False)
    render_summary(summary, console, run_dir=tmp_path / "gone")
    assert "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n" == fallback


def test_the_faults_table_says_why_a_window_has_no_recovery_time(golden_run):
    """One window per `slo.recovery.Recovery` value, as the summary writes them, and one from a
    summary that predates the field; the HTML card says the same as the console."""
    figures = {"start_s": 4.0, "end_s": 6.0, "goodput_before_per_s": 2.0,
               "goodput_during_per_s": 0.0, "attainment_in_window": 0.0,
               "outcomes_in_window": {"error/connection_refused": 4}}  # fmt: skip
    windows = [
        {**figures, "kind": "down", "recovery_s": 0.75, "recovery": "recovered"},
        {**figures, "kind": "stall", "recovery_s": None, "recovery": "never"},
        {**figures, "kind": "reset_peer", "recovery_s": None, "recovery": "run_ended_in_window"},
        {**figures, "kind": "latency", "recovery_s": None, "recovery": "no_level_before"},
        {**figures, "kind": "slicer", "recovery_s": None},
    ]
    windows = [FaultWindow.from_dict(w) for w in windows]
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(faults_table(windows))
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    cells = {line.split()[0]: line for line in lines}  # the row of each fault kind
    assert "0.75" in cells["down"]
    assert "never" in cells["stall"] and "run ended in window" in cells["reset_peer"]
    assert "no goodput before" in cells["latency"] and "never" in cells["slicer"]
    assert "never" not in cells["reset_peer"] + cells["latency"]
    card = dataclasses.replace(build_card(golden_run), faults=windows)
    html = render_html(card)
    assert "<td>run ended in window</td>" in html and "<td>no goodput before</td>" in html
