"""The card's sessions section: its sentence, its by-turn rows, and both renderings."""

from __future__ import annotations

import dataclasses

from rich.console import Console

from reports.build import build_card
from reports.console import card_renderable
from reports.html import render_html
from reports.sessions_view import session_rows, sessions_sentence
from slo.runrecord import Sessions

RAW = {
    "sessions": 4,
    "complete": 3,
    "turns": {"mean": 2.5},
    "turns_not_sent": 2,
    "duration_s": {"p50": 0.6474, "p90": 1.0267},
    "by_turn": [
        {"turn": 0, "n": 4, "ok": 4, "ttft_ms": {"p50": 32.58, "p90": 56.85},
         "prompt_tokens_mean": 94.25, "cached_tokens_mean": 12.0, "cache_hit_rate": 0.1273},
        {"turn": 1, "n": 4, "ok": 3, "ttft_ms": {"p50": None, "p90": None},
         "prompt_tokens_mean": 167.0, "cached_tokens_mean": None, "cache_hit_rate": None},
    ],
    "cache_hit_rate": 0.5977,
}  # fmt: skip
BLOCK = Sessions.from_dict(RAW)


def test_sentence_and_rows():
    assert sessions_sentence(BLOCK) == (
        "4 sessions (3 complete, 2.5 turns on average, 2 turns not sent); session duration p50 "
        "0.65 s, p90 1.03 s; prefix-cache hit rate 59.8% (usage.prompt_tokens_details.cached_tokens)"
    )
    assert session_rows(BLOCK) == [
        ("0", "4", "4", "32.6", "56.9", "94.2", "12.0", "12.7%"),
        ("1", "4", "3", "—", "—", "167.0", "—", "—"),
    ]
    assert sessions_sentence(None) is None and session_rows(None) == []


def test_card_shows_sessions_only_for_multi_turn_runs(golden_run):
    card = build_card(golden_run)
    assert card.sessions is None and "Sessions" not in render_html(card)
    with_sessions = dataclasses.replace(card, sessions=BLOCK)
    html = render_html(with_sessions)
    assert "<h2>Sessions</h2>" in html and "<td>32.6</td>" in html
    console = Console(width=140, record=True)
    console.print(card_renderable(with_sessions))
    text = console.export_text()
    assert "4 sessions (3 complete" in text and "cache hit" in text
