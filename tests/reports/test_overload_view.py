"""The card's overload section on a run directory written by the production writer: an overload
run whose every figure is worked out by hand below, in the console, JSON and HTML cards; each
way the recovery can be judged in words; and a plain run's card without the section."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console
from rundir_builder import SyntheticRun, write_run

from reports.build import build_card
from reports.console import card_renderable
from reports.html import render_html
from reports.overload_view import little_rows, phase_rows, recovery_sentence, shedding_sentence
from slo.overload import OverloadRecovery
from slo.runrecord import Overload, RequestRecord, RunManifest, RunWriter

NS_PER_MS = 1_000_000
QUEUE_FULL = "The server is at capacity (waiting queue full); retry later."
# base (0, 1 s] at 4/s, peak (1, 2 s] at 8/s, after (2, 5 s] at 4/s, as a built workload records them
STAGES = [{"duration_s": 1.0, "rate": 4.0}, {"duration_s": 1.0, "rate": 8.0},
          {"duration_s": 3.0, "rate": 4.0}]  # fmt: skip
WORKLOAD = {"name": "overload", "parameters": {"effective": {"arrivals": {
    "process": "stages", "stages": STAGES}}}}  # fmt: skip


def _record(rid: str, sent_ms: float, ttft_ms: float | None) -> RequestRecord:
    """ok with its first token `ttft_ms` after the send and done 200 ms after that; None: shed
    (HTTP 429, answered 10 ms after the send)."""
    sent = round(sent_ms * NS_PER_MS)
    if ttft_ms is None:
        return RequestRecord(request_id=rid, t_scheduled_ns=sent, t_sent_ns=sent,
                             t_done_ns=sent + 10 * NS_PER_MS, status="rejected", http_status=429,
                             error_class="rejected_429", error_message=QUEUE_FULL)  # fmt: skip
    first = sent + round(ttft_ms * NS_PER_MS)
    return RequestRecord(request_id=rid, t_scheduled_ns=sent, t_sent_ns=sent,
                         t_first_token_ns=first, t_last_token_ns=first + 100 * NS_PER_MS,
                         t_done_ns=first + 200 * NS_PER_MS, status="ok", http_status=200,
                         input_tokens=8, output_tokens=4, output_tokens_source="usage")  # fmt: skip


def overload_records() -> list[RequestRecord]:
    """b0-b3 at 0.25 k s, TTFT 100 ms; p0-p7 at 1.125 + 0.125 k s, the odd ones shed, the even
    ones TTFT 300 ms; a0-a9 at 2.25 + 0.25 k s, TTFT 400, 300, then 100 ms."""
    rows = [_record(f"b{k}", 250 * k, 100) for k in range(4)]
    rows += [_record(f"p{k}", 1125 + 125 * k, None if k % 2 else 300) for k in range(8)]
    after = [400, 300] + [100] * 8
    rows += [_record(f"a{k}", 2250 + 250 * k, t) for k, t in enumerate(after)]
    return rows


@pytest.fixture(scope="module")
def overload_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("runs") / "overload-run"
    path.mkdir()
    writer = RunWriter(path, RunManifest(t0_ns=0, run_id="overload-run", workload=WORKLOAD))
    records = overload_records()
    writer.write_schedule([(r.request_id, r.t_scheduled_ns / 1e9, False) for r in records])
    writer.append_requests(records)
    writer.close(complete=True)
    return path


SHEDDING = (
    "Shedding started at 1.25 s (phase 1, peak): 4 of 22 requests shed (18.2%), by reason: "
    f'4 × "{QUEUE_FULL}"'
)
# base p90 100 ms, so at most 150 ms. Windows of 8 after 2 s: a0-a7 p90 330, a1-a8 160, a2-a9
# 100: back from a2, sent at 2.75 s.
RECOVERY = (
    "Recovered 0.75 s after the peak ended (2.00 s): 8 consecutive requests served, their TTFT "
    "p90 within 50.0% of the base phases' 100.0 ms (at most 150.0 ms)."
)
PHASE_ROWS = [
    ("0", "base", "0.00", "1.00", "4.00", "4", "0", "0.0%", "4", "100.0", "100.0", "300.0"),
    ("1", "peak", "1.00", "2.00", "8.00", "8", "4", "50.0%", "4", "300.0", "300.0", "500.0"),
    ("2", "after peak", "2.00", "5.00", "4.00", "10", "0", "0.0%", "10", "100.0", "310.0", "510.0"),
]
# phase 0: lambda 4/s, W 0.3 s, L = (3 x 0.3 + b3's 0.25) / 1 s = 1.15, ratio 1.15 / 1.2;
# phase 1: lambda 8/s, W = (4 x 0.5 + 4 x 0.01) / 8 = 0.255 s, lambda W 2.04, L = (b3 0.05 +
# p0, p2 0.5 each + p4 0.375 + p6 0.125 + p1, p3, p5 0.01 each; p7, sent at 2 s, after) / 1 s =
# 1.58, ratio 1.58 / 2.04; phase 2: lambda 10 / 3 s, W 0.35 s, L = (p4 0.125 + p6 0.375 + p7
# 0.01 + 0.6 + 0.5 + 8 x 0.3) / 3 s = 4.01 / 3, ratio (4.01 / 3) / (3.5 / 3). Most in flight at
# once: 2 (b0, b1 at 0.25 s), 3 (p0, p2 and the shed p3 at 1.5 s), 3 (a0, a1, a2 at 2.75 s).
LITTLE_ROWS = [
    ("0", "4.00", "0.300", "1.20", "1.15", "2", "0.958", "0"),
    ("1", "8.00", "0.255", "2.04", "1.58", "3", "0.775", "0"),
    ("2", "3.33", "0.350", "1.17", "1.34", "3", "1.146", "0"),
]


def test_the_section_has_the_hand_worked_figures(overload_run):
    block = build_card(overload_run).overload
    assert shedding_sentence(block) == SHEDDING
    assert recovery_sentence(block) == RECOVERY
    assert phase_rows(block) == PHASE_ROWS
    assert little_rows(block) == LITTLE_ROWS


def test_console_json_and_html_show_it(overload_run):
    card = build_card(overload_run)
    out = io.StringIO()
    Console(file=out, width=250, color_system=None, force_terminal=False).print(
        card_renderable(card)
    )
    text = out.getvalue()
    assert SHEDDING in text and RECOVERY in text
    cells = [line.split() for line in text.splitlines()]
    assert "2 after peak 2.00 5.00 4.00 10 0 0.0% 10 100.0 310.0 510.0".split() in cells
    assert "1 8.00 0.255 2.04 1.58 3 0.775 0".split() in cells
    block = card.to_dict()["overload"]
    assert (block["n_shed"], block["first_shed_s"], block["recovery_s"]) == (4, 1.25, 0.75)
    assert [p["little_law"]["ratio"] for p in block["phases"]] == [0.9583, 0.7745, 1.1457]
    html = render_html(card)
    assert "<h2>Overload</h2>" in html and "Little&#39;s law by phase" in html
    assert "<td>after peak</td><td>2.00</td><td>5.00</td>" in html and "<td>0.775</td>" in html


@pytest.mark.parametrize(
    ("figures", "sentence"),
    [
        ({"recovery": OverloadRecovery.NOT_RECOVERED.value},
         "Not recovered within the run: after the peak ended (2.00 s), no 8 consecutive requests "
         "served, their TTFT p90 within 50.0% of the base phases' 100.0 ms (at most 150.0 ms)."),
        ({"recovery": OverloadRecovery.TOO_FEW_AFTER.value},
         "Recovery not judged: fewer than 8 requests were sent after the peak ended (2.00 s)."),
        ({"recovery": OverloadRecovery.NO_BASE_LEVEL.value},
         "Recovery not judged: the base phases have no TTFT to come back to (no ok request, or "
         "the run was not streamed)."),
        ({"recovery": OverloadRecovery.NO_PEAK.value},
         "No phase was offered more than the first: no peak to recover from."),
        ({"recovery": OverloadRecovery.NO_PEAK.value, "phase_source": "run"},
         "The run has no load phases (no staged arrivals): it is one phase, first to last send."),
    ],
)  # fmt: skip
def test_each_way_of_judging_the_recovery_in_words(figures, sentence):
    block = Overload.from_dict(
        {"phase_source": "stages", "n_sent": 10, "n_shed": 0, "peak_end_s": 2.0,
         "base_ttft_p90_ms": 100.0, "recovery_threshold_ms": 150.0,
         "recovery_window_requests": 8, "recovery_tolerance": 0.5, **figures}
    )  # fmt: skip
    assert recovery_sentence(block) == sentence
    assert shedding_sentence(block) == "No request was shed (10 sent)."


def test_a_plain_run_has_no_overload_section(tmp_path):
    plain = SyntheticRun(n_requests=30, slo=None, write_summary=False)
    card = build_card(write_run(tmp_path / "plain", plain))
    assert card.overload is None and card.to_dict()["overload"] is None
    assert "Overload" not in render_html(card)
    console = Console(width=110, record=True)
    console.print(card_renderable(card))
    assert "Overload" not in console.export_text() and "Little" not in console.export_text()
    staged = dataclasses.replace(card, overload=Overload.from_dict({"n_sent": 30, "n_shed": 0}))
    assert "<h2>Overload</h2>" in render_html(staged)
