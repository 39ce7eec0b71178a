"""Request classes in the summary (`slo.classes`): slices by tenant and priority, Jain's index
over max-min-normalised goodput, deadline misses; hand-worked runs written with the
production writer, read back by `slo.summarize` and shown on the card."""

from __future__ import annotations

import numpy as np
import pytest
from rich.console import Console
from slo_runs import ms, write_run

from reports.build import build_card
from reports.console import card_renderable
from reports.html import render_html
from slo import summarize
from slo.classes import jain_index, max_min_shares
from slo.runrecord import RunSummary


def render_console(card) -> str:
    console = Console(width=160, record=True, color_system=None)
    with console.capture() as captured:
        console.print(card_renderable(card))
    return captured.get()


def _water_level(demands, capacity):
    """Independent max-min: the level L with sum(min(d, L)) = capacity, by bisection."""
    demands = np.asarray(demands, float)
    if capacity >= demands.sum():
        return demands
    low, high = 0.0, float(demands.max())
    for _ in range(200):
        mid = (low + high) / 2
        if np.minimum(demands, mid).sum() < capacity:
            low = mid
        else:
            high = mid
    return np.minimum(demands, (low + high) / 2)


def test_jain_index_hand_worked():
    assert jain_index(np.array([1.0, 1.0, 1.0])) == pytest.approx(1.0)
    assert jain_index(np.array([1.0, 0.0])) == pytest.approx(0.5)  # one of two got it all
    assert jain_index(np.array([1.2, 0.5])) == pytest.approx(1.7**2 / (2 * (1.44 + 0.25)))
    assert jain_index(np.array([])) is None
    assert jain_index(np.array([0.0, 0.0])) is None


def test_max_min_shares_hand_worked_and_against_water_filling():
    assert max_min_shares(np.array([2.0, 20.0]), 10.0).tolist() == [2.0, 8.0]
    assert max_min_shares(np.array([2.0, 20.0]), 3.0).tolist() == [1.5, 1.5]
    assert max_min_shares(np.array([10.0, 1.0, 2.0]), 9.0).tolist() == [6.0, 1.0, 2.0]
    assert max_min_shares(np.array([1.0, 1.0]), 5.0).tolist() == [1.0, 1.0]  # demand caps
    rng = np.random.default_rng(3)
    for _ in range(50):
        demands = rng.uniform(0, 10, size=rng.integers(1, 6))
        capacity = rng.uniform(0, demands.sum() * 1.2)
        np.testing.assert_allclose(
            max_min_shares(demands, capacity), _water_level(demands, capacity), atol=1e-9
        )


def _request(rid, sent_ms, done_ms, status="ok", **extra):
    return dict(request_id=rid, t_scheduled_ns=ms(sent_ms), t_sent_ns=ms(sent_ms),
                t_first_token_ns=None if status != "ok" else ms(sent_ms + 1),
                t_last_token_ns=None if status != "ok" else ms(done_ms), t_done_ns=ms(done_ms),
                status=status, input_tokens=8, output_tokens=2 if status == "ok" else None,
                error_class={"rejected": "rejected_429", "error": "http_5xx"}.get(status),
                **extra)  # fmt: skip


def _tenant_run(tmp_path):
    """10 s window (first send 0, last done 10,000 ms); heavy sends 8 (6 ok), light 2 (1 ok).
    Demands 0.8 and 0.2 req/s, goodput 0.6 and 0.1; max-min shares of 0.7: light 0.2 (below
    the equal 0.35), heavy the other 0.5; normalised 1.2 and 0.5; Jain (1.7)^2 / (2 * 1.69)."""
    rows = []
    for i in range(8):
        rows.append(_request(f"h{i}", 100 * i, 10_000 if i == 0 else 100 * i + 50,
                             "ok" if i < 6 else "rejected", tenant="heavy", priority=1))  # fmt: skip
    rows.append(_request("l0", 500, 600, "ok", tenant="light", priority=0))
    rows.append(_request("l1", 700, 800, "error", tenant="light", priority=0))
    return write_run(tmp_path / "run", rows, [])


def test_tenant_fairness_and_slices_hand_worked(tmp_path):
    summary = summarize(_tenant_run(tmp_path))
    fairness = summary["fairness"]
    assert fairness["window_s"] == pytest.approx(10.0)
    heavy, light = fairness["tenants"]
    assert (heavy["tenant"], light["tenant"]) == ("heavy", "light")
    assert heavy["sent_request_per_s"] == pytest.approx(0.8)
    assert light["goodput_request_per_s"] == pytest.approx(0.1)
    assert heavy["fair_share_request_per_s"] == pytest.approx(0.5)
    assert light["fair_share_request_per_s"] == pytest.approx(0.2)
    assert heavy["normalised_goodput"] == pytest.approx(1.2)
    assert light["normalised_goodput"] == pytest.approx(0.5)
    assert fairness["jain_index"] == pytest.approx(2.89 / 3.38)
    assert fairness["raw_jain_index"] == pytest.approx(0.49 / (2 * 0.37))
    tenant_slices = {s["label"]: s for s in summary["slices"]["tenant"]}
    assert tenant_slices["heavy"]["n"] == 8 and tenant_slices["heavy"]["counts"]["ok"] == 6
    assert tenant_slices["light"]["error_rate"] == pytest.approx(0.5)
    priority_slices = {s["label"]: s["n"] for s in summary["slices"]["priority"]}
    assert priority_slices == {"0": 2, "1": 8}
    assert summary["deadlines"] is None
    read = RunSummary.from_dict(summary)
    assert read.fairness.tenants[1].normalised_goodput == pytest.approx(0.5)


def test_a_run_without_classes_has_no_class_blocks(tmp_path):
    run = write_run(tmp_path / "run", [_request("a", 0, 10), _request("b", 5, 20)], [])
    summary = summarize(run)
    assert summary["fairness"] is None and summary["deadlines"] is None
    assert "tenant" not in summary["slices"] and "priority" not in summary["slices"]
    card = build_card(run)
    assert "Jain" not in render_console(card) and "Tenants and deadlines" not in render_html(card)


def _deadline_run(tmp_path):
    rows = [
        _request("met", 0, 100, deadline_ms=100),  # e2e 100 = deadline: met
        _request("late", 0, 101, deadline_ms=100),  # one ms over
        _request("cut", 0, 50, deadline_ms=100, finish_reason="deadline"),  # the server ended it
        _request("refused", 10, 11, "rejected", deadline_ms=100),
        _request("broken", 10, 20, "error", deadline_ms=100),
        _request("free", 0, 5000),  # no deadline: not counted
        dict(request_id="unsent", status="not_sent", deadline_ms=100),  # never sent: left out
    ]
    return write_run(tmp_path / "run", rows, [])


def test_deadline_misses_hand_worked(tmp_path):
    deadlines = summarize(_deadline_run(tmp_path))["deadlines"]
    assert {k: v for k, v in deadlines.items() if k != "definition"} == {
        "with_deadline": 5,
        "met_deadline": 1,
        "missed_deadline": 4,
        "miss_rate": 0.8,
        "finished_late": 1,
        "dropped_by_server": 1,
        "rejected_at_admission": 1,
        "failed_otherwise": 1,
    }


def test_the_card_shows_tenants_and_deadlines(tmp_path):
    card = build_card(_tenant_run(tmp_path))
    text = render_console(card)
    assert "Jain's fairness index 0.855 over 2 tenants" in text
    assert "heavy" in text and "1.200" in text
    html = render_html(card)
    assert "Tenants and deadlines" in html and "0.855" in html
    assert card.to_dict()["fairness"]["jain_index"] == pytest.approx(0.855, abs=1e-3)
    deadline_card = build_card(_deadline_run(tmp_path / "d"))
    sentence = "deadlines: 1 of 5 met, miss rate 80.0% (1 late, 1 dropped by the server"
    assert sentence in render_console(deadline_card)
    assert sentence in render_html(deadline_card)
