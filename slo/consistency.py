"""Consistency checks on the records themselves.

Little's law (L = lambda * W) ties three figures that are computed here independently:
L, the time-averaged number of requests in flight, by integrating the step function
N(t) (+1 at each send, -1 at each done) over the window; lambda, the arrival rate, sends
per second of the window; W, the mean send-to-done time of requests that finished. With
complete, sane records over a window that holds every request the two sides agree
(ratio 1). Requests that were sent but never finished (lost records, an interrupted
run) stay in flight to the end of the window and count as arrivals but not in W, and
done times before send times or outside the window (a broken clock) enter W but not L;
either moves the ratio away from 1, in a direction that depends on when they happened,
so `unfinished` and `negative_latencies` are reported alongside. Over a
sub-window (`window_ns`) edge effects make it an approximation, good when the window is
long compared with W.
"""

from __future__ import annotations

import numpy as np

from slo.metrics import NS_PER_S

DEFAULT_TOLERANCE = 0.05


def mean_in_flight(
    t_sent_ns: np.ndarray, t_done_ns: np.ndarray, start_ns: float, end_ns: float
) -> tuple[float, int]:
    """(time-averaged in-flight count, peak in-flight count) over [start_ns, end_ns].

    A request is in flight from its send to its done time; one with no done time stays in
    flight to `end_ns`. Never-sent requests (NaN send) are ignored. A done time before its
    send time contributes nothing.
    """
    sent = np.asarray(t_sent_ns, float)
    done = np.asarray(t_done_ns, float)
    keep = ~np.isnan(sent)
    sent, done = sent[keep], done[keep]
    done = np.where(np.isnan(done), end_ns, done)
    done = np.maximum(done, sent)
    begin = np.clip(sent, start_ns, end_ns)
    finish = np.clip(done, start_ns, end_ns)
    times = np.concatenate([begin, finish])
    steps = np.concatenate([np.ones(begin.size), -np.ones(finish.size)])
    # at equal times apply departures first, so back-to-back requests do not overlap
    order = np.lexsort((steps, times))
    times, steps = times[order], steps[order]
    count = np.cumsum(steps)
    span = end_ns - start_ns
    if span <= 0 or times.size == 0:
        return 0.0, 0
    area = float(np.sum(count[:-1] * np.diff(times)))
    return area / span, int(count.max(initial=0))


def littles_law(
    t_sent_ns: np.ndarray,
    t_done_ns: np.ndarray,
    *,
    window_ns: tuple[float, float] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> dict:
    """Little's-law check over `window_ns` (default: first send to last send-or-done).

    Returns `{mean_in_flight, peak_in_flight, arrival_rate_per_s, mean_latency_s,
    ratio, unfinished, negative_latencies, consistent, window_s}`: `ratio` is
    mean_in_flight / (arrival_rate * mean_latency) (None when the right side is 0 or
    undefined); `consistent` is false when |ratio - 1| > `tolerance` or any request was
    sent and never finished. Over an explicit window, arrivals and latencies are those of
    requests sent inside it.
    """
    sent = np.asarray(t_sent_ns, float)
    done = np.asarray(t_done_ns, float)
    was_sent = ~np.isnan(sent)
    empty = {
        "mean_in_flight": None, "peak_in_flight": 0, "arrival_rate_per_s": None,
        "mean_latency_s": None, "ratio": None, "unfinished": 0, "negative_latencies": 0,
        "consistent": True, "window_s": None,
    }  # fmt: skip
    if not was_sent.any():
        return empty
    if window_ns is None:
        start_ns = float(np.nanmin(sent))
        end_ns = float(np.nanmax(np.concatenate([sent, done])))
    else:
        start_ns, end_ns = float(window_ns[0]), float(window_ns[1])
    window_s = (end_ns - start_ns) / NS_PER_S
    if window_s <= 0:
        return empty
    in_window = was_sent & (sent >= start_ns) & (sent <= end_ns)
    latency_s = (done[in_window] - sent[in_window]) / NS_PER_S
    finished = ~np.isnan(latency_s)
    mean_latency_s = float(latency_s[finished].mean()) if finished.any() else None
    arrival_rate = float(in_window.sum()) / window_s
    mean_l, peak = mean_in_flight(sent, done, start_ns, end_ns)
    predicted = arrival_rate * mean_latency_s if mean_latency_s is not None else None
    ratio = mean_l / predicted if predicted else None
    unfinished = int((~finished).sum())
    return {
        "mean_in_flight": mean_l,
        "peak_in_flight": peak,
        "arrival_rate_per_s": arrival_rate,
        "mean_latency_s": mean_latency_s,
        "ratio": ratio,
        "unfinished": unfinished,
        "negative_latencies": int((latency_s[finished] < 0).sum()),
        "consistent": bool(ratio is not None and abs(ratio - 1) <= tolerance and unfinished == 0),
        "window_s": window_s,
    }
