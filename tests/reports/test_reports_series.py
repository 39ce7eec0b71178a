"""Chart data reduction and the failure taxonomy, against hand-worked cases."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from reports.series import (
    CDF_POINTS,
    cdf_points,
    choose_bin_s,
    outcomes_over_time,
    percentiles_over_time,
)
from reports.taxonomy import classify_outcomes, count_outcomes

NaN = float("nan")


def test_cdf_of_few_values_keeps_every_value():
    assert cdf_points(np.array([3.0, 1.0, NaN, 2.0, 2.0])) == [
        [1.0, 0.25],
        [2.0, 0.5],
        [2.0, 0.75],
        [3.0, 1.0],
    ]
    assert cdf_points(np.array([NaN])) == []


def test_cdf_of_many_values_is_percentiles():
    values = np.arange(1001, dtype=float)  # percentile q of 0..1000 is exactly 10 * q
    points = cdf_points(values)
    assert len(points) == CDF_POINTS
    assert points[0] == [0.0, 0.0] and points[50] == [500.0, 0.5] and points[-1] == [1000.0, 1.0]


@pytest.mark.parametrize(
    ("span_s", "expected"),
    [(None, None), (0.0, None), (3.0, 0.1), (44.0, 2.0), (100.0, 5.0), (1e6, 600.0)],
)
def test_bin_width_is_a_round_number(span_s, expected):
    assert choose_bin_s(span_s) == expected


def test_percentiles_over_time_hand_case():
    # Bin 0 (0 <= t < 2 s): values 10, 20, 30 -> p50 20, p90 28; bin 1 is empty; bin 2: 5.
    t_ns = np.array([0.1e9, 1.0e9, 1.9e9, 4.5e9, 0.5e9])
    values = np.array([10.0, 20.0, 30.0, 5.0, NaN])
    assert percentiles_over_time(t_ns, values, 2.0) == [[0.0, 20.0, 28.0], [4.0, 5.0, 5.0]]
    assert percentiles_over_time(t_ns, values, None) == []


def test_outcomes_over_time_keeps_empty_bins():
    t_ns = np.array([0.5e9, 0.7e9, 2.5e9, NaN])
    kinds = np.array(["ok", "timeout", "ok", "ok"], dtype=object)
    rows = outcomes_over_time(t_ns, kinds, 1.0)
    assert [(r["t_s"], r["ok"], r["timeout"]) for r in rows] == [
        (0.0, 1, 1),
        (1.0, 0, 0),
        (2.0, 1, 0),
    ]


def test_outcomes_over_time_refuses_times_not_aligned_with_outcomes():
    """Three sent rows' times against five scheduled rows' outcomes (two never sent)."""
    t_ns = np.array([0.5e9, 0.7e9, 2.5e9])
    kinds = np.array(["error", "error", "error", "not_sent", "not_sent"], dtype=object)
    with pytest.raises(ValueError, match="3 times for 5 outcomes"):
        outcomes_over_time(t_ns, kinds, 1.0)


def test_taxonomy_hand_table():
    table = pa.table(
        {
            "status": [
                "ok",
                "ok",
                "error",
                "rejected",
                "error",
                "timeout",
                "cancelled",
                None,
                "unknown",
                "error",
            ],
            "error_class": [
                None,
                None,
                "http_5xx",
                "rejected_429",
                "http_4xx",
                "timeout",
                None,
                None,
                "connection_reset",
                "http_5xx",
            ],
            "error_message": [
                None,
                None,
                "CUDA out of memory. Tried",
                None,
                "too many",
                None,
                None,
                None,
                None,
                "boom",
            ],
            "http_status": [200, 200, 500, 429, 429, None, None, None, None, 503],
            "output_tokens": [5, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        }
    )
    kinds = classify_outcomes(table)
    assert list(kinds) == [
        "ok", "wrong_output", "oom", "rejected", "rejected", "timeout", "cancelled", "unknown", "unknown", "error",
    ]  # fmt: skip
    counts = count_outcomes(kinds)
    assert sum(counts.values()) == 10 and counts["unknown"] == 2


def test_output_valid_column_marks_wrong_output():
    table = pa.table(
        {"status": ["ok", "ok"], "output_tokens": [4, 4], "output_valid": [False, None]}
    )
    assert list(classify_outcomes(table)) == ["wrong_output", "ok"]
