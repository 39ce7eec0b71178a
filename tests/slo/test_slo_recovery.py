"""Recovery figures against a hand-worked run: 1 ok request per 0.5 s, a fault from 4 s to 6 s
during which every request fails, then back to normal from 7 s (or, for `never`, failing on to
the end)."""

from __future__ import annotations

from slo_runs import ms, request_metrics

from slo.recovery import Recovery, recovery_for_window


def _run(fail_until_ms: float = 7000):
    rows = []
    for i in range(24):  # sent every 0.5 s from 0 to 11.5 s, each done 100 ms later
        t = 500.0 * i
        failed = 4000 <= t < fail_until_ms  # the fault, and (by default) 1 s of aftermath
        rows.append(
            dict(
                request_id=f"r{i}",
                t_scheduled_ns=ms(t),
                t_sent_ns=ms(t),
                t_first_token_ns=None if failed else ms(t + 50),
                t_last_token_ns=None if failed else ms(t + 90),
                t_done_ns=ms(t + 100),
                status="error" if failed else "ok",
                error_class="connection_refused" if failed else None,
                input_tokens=8,
                output_tokens=0 if failed else 2,
                output_tokens_source="usage",
            )  # fmt: skip
        )
    return request_metrics(rows, [])


def test_recovery_worked_by_hand():
    w = recovery_for_window(_run(), {"kind": "down", "start_s": 4.0, "end_s": 6.0}, bin_s=1.0)
    # Before: [2, 4) holds the ok completions at 2.1, 2.6, 3.1, 3.6 s: 4 in 2 s = 2/s.
    assert w["goodput_before_per_s"] == 2.0
    assert w["goodput_during_per_s"] == 0.0
    # After the fault ends at 6 s, bins slide by 0.25 s. The first ok completion is 7.1 s (sent
    # 7.0); [6.5, 7.5) holds only it (1/s), [6.75, 7.75) holds 7.1 and 7.6: 2/s >= 90% of 2/s.
    assert w["recovery_s"] == 0.75 and w["recovery"] == Recovery.RECOVERED
    # Sent inside [4, 6): 4 requests, all failed.
    assert w["requests_in_window"] == 4 and w["attainment_in_window"] == 0.0
    assert w["outcomes_in_window"] == {"error/connection_refused": 4}


def test_never_recovered_and_no_level_before():
    rm = _run()
    never = recovery_for_window(rm, {"kind": "down", "start_s": 4.0, "end_s": 11.5}, bin_s=1.0)
    assert never["recovery_s"] is None  # the run ends before a whole bin after the fault
    at_start = recovery_for_window(rm, {"kind": "latency", "start_s": 0.0, "end_s": 1.0})
    assert at_start["goodput_before_per_s"] is None and at_start["recovery_s"] is None


def test_why_there_is_no_recovery_figure():
    """Three windows without a recovery time, each for its own reason."""
    # Requests fail from 4 s to the end; the window is 4-6 s. Before: 2/s (as above). The run
    # ends at 11.6 s (the last failure); every whole 1 s bin from 6 s ([6, 7) ... [10.5, 11.5)
    # by quarter steps) holds no good request: goodput never came back.
    never = recovery_for_window(
        _run(fail_until_ms=12_000), {"kind": "down", "start_s": 4.0, "end_s": 6.0}, bin_s=1.0
    )
    assert never["goodput_before_per_s"] == 2.0
    assert never["recovery_s"] is None and never["recovery"] == Recovery.NEVER
    # A window from 10 s to 11.5 s, the last send: before, [8.5, 10) holds 8.6, 9.1, 9.6 s, 3
    # in 1.5 s = 2/s, and every request in the window is ok; but the run ends at 11.6 s, before
    # a whole bin after the window (12.5 s), so there was no time after it to recover in.
    ended = recovery_for_window(_run(), {"kind": "latency", "start_s": 10.0, "end_s": 11.5})
    assert ended["goodput_before_per_s"] == 2.0 and ended["attainment_in_window"] == 1.0
    assert ended["recovery_s"] is None and ended["recovery"] == Recovery.RUN_ENDED_IN_WINDOW
    open_ended = recovery_for_window(_run(), {"kind": "down", "start_s": 10.0, "end_s": None})
    assert open_ended["recovery"] == Recovery.RUN_ENDED_IN_WINDOW
    # From 0 s to 1 s: no run before it, so no level to get back to.
    at_start = recovery_for_window(_run(), {"kind": "latency", "start_s": 0.0, "end_s": 1.0})
    assert at_start["goodput_before_per_s"] is None
    assert at_start["recovery_s"] is None and at_start["recovery"] == Recovery.NO_LEVEL_BEFORE
