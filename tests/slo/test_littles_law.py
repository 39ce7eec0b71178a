"""Little's law per load phase (`slo.littles_law`), read from `slo.summarize` on run directories
written by the production writer: a hand-worked case with every integral written out, the phase
boundaries (a send just below, at and past a boundary), and an independent implementation that
samples the in-flight count on a fine grid."""

from __future__ import annotations

import numpy as np
import pytest
from slo_runs import ms, write_run

import slo
from slo.littles_law import littles_law_by_phase
from slo.load_phases import LoadPhase, load_phases, phase_of
from slo.runrecord import RunSummary


def staged(*stages: tuple[float, float]) -> dict:
    """A manifest's `workload` whose arrivals were built as these (duration_s, rate) stages."""
    arrivals = {"process": "stages", "stages": [{"duration_s": d, "rate": r} for d, r in stages]}
    return {"name": "staged", "parameters": {"effective": {"arrivals": arrivals}}}


def ok(rid: str, sent_ms: float, done_ms: float | None) -> dict:
    return dict(request_id=rid, t_scheduled_ns=ms(sent_ms), t_sent_ns=ms(sent_ms),
                t_first_token_ns=ms(sent_ms + 1), t_last_token_ns=ms(sent_ms + 1),
                t_done_ns=ms(done_ms), status="ok" if done_ms is not None else "unknown",
                input_tokens=8, output_tokens=1)  # fmt: skip


def phases_of(tmp_path, rows: list[dict], workload: dict) -> list:
    run = write_run(tmp_path / "run", rows, [], manifest={"workload": workload})
    block = RunSummary.from_dict(slo.summarize(run)).overload
    assert block is not None
    return block.phases


# Four requests over two 1 s stages (ms): A 0 -> 500, B 500 -> 1500, C 1100 -> 1350, D 1500 -> 2500.
HAND = [ok("A", 0, 500), ok("B", 500, 1500), ok("C", 1100, 1350), ok("D", 1500, 2500)]


def test_hand_worked_phases(tmp_path):
    p0, p1 = phases_of(tmp_path, HAND, staged((1.0, 2.0), (1.0, 2.0)))
    # phase 0 [0, 1 s]: A and B sent, lambda = 2/s; W = (0.5 + 1.0) / 2 = 0.75 s; lambda W = 1.5.
    # L = (A in flight 0-0.5 + B 0.5-1.0) / 1 s = 1.0 (B's second half is phase 1's); ratio 2/3.
    assert (p0.phase, p0.start_s, p0.end_s, p0.n_sent) == (0, 0.0, 1.0, 2)
    little = p0.little_law
    assert little.arrival_rate_per_s == pytest.approx(2.0)
    assert little.mean_time_in_system_s == pytest.approx(0.75)
    assert little.predicted_in_flight == pytest.approx(1.5)
    assert little.mean_in_flight == pytest.approx(1.0)
    assert little.ratio == pytest.approx(2 / 3)
    assert (little.peak_in_flight, little.unfinished) == (1, 0)  # A leaves as B arrives
    # phase 1 [1, 2 s]: C and D sent, lambda = 2/s; W = (0.25 + 1.0) / 2 = 0.625 s; lambda W = 1.25.
    # L = (B 1.0-1.5: 0.5 + C 1.1-1.35: 0.25 + D 1.5-2.0: 0.5) / 1 s = 1.25; ratio 1.
    assert (p1.phase, p1.start_s, p1.end_s, p1.n_sent) == (1, 1.0, 2.0, 2)
    little = p1.little_law
    assert little.arrival_rate_per_s == pytest.approx(2.0)
    assert little.mean_time_in_system_s == pytest.approx(0.625)
    assert little.predicted_in_flight == pytest.approx(1.25)
    assert little.mean_in_flight == pytest.approx(1.25)
    assert little.ratio == pytest.approx(1.0)
    assert little.peak_in_flight == 2  # B and C from 1.1 to 1.35 s


def test_an_unfinished_request_counts_in_lambda_and_l_not_in_w(tmp_path):
    rows = [*HAND, ok("E", 1800, None)]  # sent, never done: in flight to the end of phase 1
    _, p1 = phases_of(tmp_path, rows, staged((1.0, 2.0), (1.0, 2.0)))
    little = p1.little_law
    # lambda = 3/s; W over C and D only = 0.625 s; lambda W = 1.875; L = 1.25 + E's 0.2 = 1.45.
    assert little.arrival_rate_per_s == pytest.approx(3.0)
    assert little.mean_time_in_system_s == pytest.approx(0.625)
    assert little.mean_in_flight == pytest.approx(1.45)
    assert little.ratio == pytest.approx(1.45 / 1.875)
    assert little.unfinished == 1


@pytest.mark.parametrize(
    ("scheduled_ms", "phase"),
    [(0.0, 0), (999.999, 0), (1000.0, 0), (1000.001, 1), (2000.0, 1), (2500.0, 1)],
)
def test_a_request_belongs_to_the_stage_that_scheduled_it(scheduled_ms, phase):
    # a stage draws its arrivals in (start, end]: evenly spaced, its last one falls on its end
    phases = [LoadPhase(0, 0.0, 1e9, 2.0), LoadPhase(1, 1e9, 2e9, 4.0)]
    sent = np.array([scheduled_ms * 1e6 + 3e6])  # sent 3 ms late: the schedule decides
    assert phase_of(np.array([scheduled_ms * 1e6]), sent, phases).tolist() == [phase]
    assert phase_of(np.array([np.nan]), sent - 3e6, phases).tolist() == [phase]  # no schedule


def test_a_late_send_extends_the_last_phase_only():
    phases = load_phases(staged((1.0, 2.0), (1.0, 4.0)), np.array([0.0, ms(2500), np.nan]))
    assert [(p.start_ns, p.end_ns, p.offered_rate_per_s) for p in phases] == [
        (0.0, 1e9, 2.0),
        (1e9, 2.5e9, 4.0),
    ]
    assert phase_of(np.array([0.0]), np.array([np.nan]), phases).tolist() == [-1]  # never sent


def test_a_run_without_stages_is_one_phase_from_first_to_last_send():
    sent = np.array([ms(100), ms(400), ms(250), np.nan])
    for workload in (None, {}, {"parameters": {"effective": {"arrivals": {"process": "poisson"}}}}):
        (only,) = load_phases(workload, sent)
        assert (only.start_ns, only.end_ns, only.offered_rate_per_s) == (ms(100), ms(400), None)
    assert load_phases(None, np.array([np.nan])) == []


def test_a_phase_of_no_length_has_no_rate_and_no_ratio():
    sent = np.array([5e8])
    (only,) = littles_law_by_phase(sent, sent, np.array([6e8]), [LoadPhase(0, 5e8, 5e8)])
    assert (only.arrival_rate_per_s, only.mean_in_flight, only.ratio) == (None, None, None)
    assert only.mean_time_in_system_s == pytest.approx(0.1)


def sampled_in_flight(sent, done, start, end, step):
    """The independent implementation: N(t) at the midpoints of a fine grid, averaged."""
    t = np.arange(start + step / 2, end, step)
    finish = np.where(np.isnan(done), np.inf, done)
    return ((sent[:, None] <= t) & (t < finish[:, None])).sum(axis=0).mean()


@pytest.mark.parametrize("seed", range(5))
def test_measured_l_matches_a_sampled_in_flight_count(seed):
    rng = np.random.default_rng(seed)
    n = 40
    sent = np.sort(rng.uniform(0, 3e9, n))
    done = sent + rng.exponential(0.4e9, n)
    done[rng.random(n) < 0.1] = np.nan  # some never finish
    phases = [LoadPhase(0, 0.0, 1e9, 1.0), LoadPhase(1, 1e9, 2.2e9, 3.0), LoadPhase(2, 2.2e9, 3e9)]
    index = phase_of(sent, sent, phases)
    for phase, little in zip(phases, littles_law_by_phase(sent, sent, done, phases), strict=True):
        expected_l = sampled_in_flight(sent, done, phase.start_ns, phase.end_ns, 1e5)
        assert little.mean_in_flight == pytest.approx(expected_l, abs=2e-3)
        mine = index == phase.index
        latency = (done[mine] - sent[mine])[~np.isnan(done[mine])] / 1e9
        assert little.arrival_rate_per_s == pytest.approx(mine.sum() / phase.length_s)
        assert little.mean_time_in_system_s == pytest.approx(latency.mean())
        assert little.unfinished == int(np.isnan(done[mine]).sum())
